//! How a task that found nothing to receive waits: poll the completion
//! queue for a while (spin), then arm it and park on its completion event.
//!
//! Parking costs a round of system calls and a wake-up (arm the CQ, the
//! event's read, a reactor turn, on the multi-thread runtime often a
//! futex between workers); when the peer answers within a few round
//! trips, polling the CQ until the answer lands is cheaper and faster.
//! [`SpinBudget`] learns from the connection's recent waits how long
//! spinning pays, and while it learnt not to spin still probes one wait in
//! [`PROBE_ONE_IN`] (no clock and no I/O here: the caller measures); the
//! connection keeps one [`SpinWait`] for the wait in progress.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::{ADAPTIVE_SPIN_START, MIN_SPIN, WaitStrategy};

/// One in this many waits of a connection whose learnt budget is zero
/// spins the full limit anyway (a probe), at random.
///
/// Without probes two ends of a ping-pong that both park stay parked: each
/// sees the other's slow, parked answers (on the multi-thread runtime in
/// the Soft-RoCE guest, 200-400 us against the then fixed 100 us limit)
/// and halves its budget to zero, although both spinning answer within the
/// limit (about 70 us there). A probe of each end in the same round trip
/// finds that out: with one in 8 per end, one round trip in 64 on average.
/// An idle or slow connection pays one spin of the limit per 8 waits.
pub(crate) const PROBE_ONE_IN: u64 = 8;

/// The limit is reviewed once per this many waits (16): often enough to
/// reach [`DEFAULT_SPIN_MAX`] from [`ADAPTIVE_SPIN_START`] (four
/// doublings) within about 150 waits where spins keep catching answers
/// near the limit (the spread-answers unit test: 144), seldom enough that
/// each review sees a few new waits of both kinds.
pub(crate) const LIMIT_REVIEW_WAITS: u32 = 16;

/// Samples older than this many review periods (4, so 64 waits) without a
/// review are dropped: a review weighs what the connection does now, not
/// a near-limit answer from before a long idle spell.
pub(crate) const STALE_REVIEWS: u32 = 4;

/// The adaptive budget and its limit (pure: the caller passes measured
/// waits and the probes' random seed).
///
/// The budget is a *limit* while the connection's waits are answered
/// within it (halved by each wait that outlasts it, see
/// [`WaitStrategy::Adaptive`]), and the limit is itself learnt: it starts at
/// [`ADAPTIVE_SPIN_START`] (or `max` if that is lower) and doubles, up to
/// `max`, while parking is measured to cost this connection more than the
/// limit and spins that ran past half the limit still caught answers. The
/// cost of a park, as seen here, is how much later a parked wait ends
/// than a wait answered while spinning: the gap between the running means
/// (weight 1/8) of the two kinds, counting only parked waits within `max`
/// (a longer one is an idle peer, which no spin would have caught) that
/// were not parked for other connections' sake (a wait whose budget was
/// zero parks before that check and does count: it is a plain park).
/// That is the ski-rental rule behind spin-then-block (Karlin, Manasse,
/// McGeoch and Owicki, "Competitive randomized algorithms for non-uniform
/// problems", 1994): spin for as long as parking costs. The limit halves,
/// not below its start, when that gap is under half the limit. A review
/// needs a new wait of each kind since the last one, so idle waits change
/// nothing, and within [`STALE_REVIEWS`] periods, so samples from before
/// an idle spell do not count.
///
/// The gap also holds how much later the peer answers the waits that
/// outlast the budget, so it overstates a park's cost where the peer's
/// answer times spread: the second condition keeps a peer that answers
/// either at once or only much later (say 5 us or 600 us) at the start,
/// but a peer whose answers spread evenly from 50 us to `max` lets the
/// limit grow even on a NIC, where a park costs a few microseconds. A
/// direct measure of a park's cost (from the completion's arrival to the
/// reader's poll) would need a timestamp the CQ does not give. In the
/// Soft-RoCE guest under TCG a parked wait ended 0.2-2 ms after the
/// peer's answer, where both ends spinning answer in about 70 us
/// (benches/history/echo-2026-12-01-to-03.md, "A spin limit learnt from what a park costs").
///
/// [`DEFAULT_SPIN_MAX`]: crate::config::DEFAULT_SPIN_MAX
/// [`ADAPTIVE_SPIN_START`]: crate::config::ADAPTIVE_SPIN_START
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SpinBudget {
    budget: Duration,
    /// The learnt limit: `start..=max`.
    limit: Duration,
    start: Duration,
    max: Duration,
    /// Running mean of parked waits within `max`.
    parked_mean: Option<Duration>,
    /// Running mean of waits answered while spinning.
    spun_mean: Option<Duration>,
    /// Waits since the limit was last reviewed.
    since_review: u32,
    /// Since the last review: a parked wait fed `parked_mean`, a spun
    /// wait fed `spun_mean`, a spun wait took more than half the limit.
    fresh_parked: bool,
    fresh_spun: bool,
    spun_near_limit: bool,
    /// xorshift64 state for the probes (never 0).
    rng: u64,
}

/// `mean` moved 1/8 of the way to `sample` (the first sample sets it).
fn running_mean(mean: Option<Duration>, sample: Duration) -> Duration {
    match mean {
        None => sample,
        Some(m) if sample >= m => m + (sample - m) / 8,
        Some(m) => m - (m - sample) / 8,
    }
}

/// How a wait ended, for [`SpinBudget::learn`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Answered while spinning.
    Spun,
    /// Answered while spinning, with other tasks on the runtime.
    SpunShared,
    /// Parked on the completion event (a sample of what a park costs).
    Parked,
    /// Parked at once because other connections were at work (no sample).
    Contended,
}

impl SpinBudget {
    /// Starts with budget and limit at `start` (or `max` if lower): a
    /// fresh connection spins its first wait that long. A `max` below
    /// [`MIN_SPIN`] never spins. `seed` picks the probes.
    pub(crate) fn new(start: Duration, max: Duration, seed: u64) -> Self {
        let max = if max < MIN_SPIN { Duration::ZERO } else { max };
        let start = start.max(MIN_SPIN).min(max);
        SpinBudget {
            budget: start,
            limit: start,
            start,
            max,
            parked_mean: None,
            spun_mean: None,
            since_review: 0,
            fresh_parked: false,
            fresh_spun: false,
            spun_near_limit: false,
            rng: splitmix64(seed) | 1,
        }
    }

    /// The learnt budget.
    pub(crate) fn budget(&self) -> Duration {
        self.budget
    }

    /// The learnt limit.
    pub(crate) fn limit(&self) -> Duration {
        self.limit
    }

    /// How long the next wait spins before it parks: the learnt budget,
    /// or, while that is zero, the limit for one wait in
    /// [`PROBE_ONE_IN`].
    pub(crate) fn next_wait(&mut self) -> Duration {
        if !self.budget.is_zero() || self.max.is_zero() {
            return self.budget;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        if self.rng % PROBE_ONE_IN == 0 {
            self.limit
        } else {
            Duration::ZERO
        }
    }

    /// One finished wait: it took `waited` from the moment the task found
    /// nothing to the moment it had something; `parked` if it parked on
    /// the completion event meanwhile (`waited` then includes the wake-up).
    pub(crate) fn record(&mut self, waited: Duration, parked: bool) {
        let how = if parked { Ended::Parked } else { Ended::Spun };
        self.learn(waited, how);
    }

    /// A wait answered while spinning on a runtime that has other tasks
    /// besides the crate's own and the waiting task
    /// ([`crate::verbs::tasks::other_tasks_on_runtime`]): the next wait spins
    /// about twice this one, not the limit, since a longer spin holds up
    /// tasks that the answer may wait for.
    pub(crate) fn record_spun_shared(&mut self, waited: Duration) {
        self.learn(waited, Ended::SpunShared);
    }

    /// A wait that parked at once because other connections were at work:
    /// teaches the budget as a parked wait, but is no sample of what a
    /// park costs (it did not try spinning).
    pub(crate) fn record_contended(&mut self, waited: Duration) {
        self.learn(waited, Ended::Contended);
    }

    fn learn(&mut self, waited: Duration, how: Ended) {
        if self.max.is_zero() {
            return;
        }
        let parked = matches!(how, Ended::Parked | Ended::Contended);
        if !parked {
            self.spun_mean = Some(running_mean(self.spun_mean, waited));
            self.fresh_spun = true;
            self.spun_near_limit |= waited > self.limit / 2;
        } else if how == Ended::Parked && waited <= self.max {
            self.parked_mean = Some(running_mean(self.parked_mean, waited));
            self.fresh_parked = true;
        }
        let twice = waited.saturating_mul(2).clamp(MIN_SPIN, self.limit);
        if how == Ended::SpunShared {
            // Other tasks share the thread: spin about twice the usual
            // wait, then park and let them run (a task this one woke, such
            // as the writer of a pipelined exchange, cannot run while it
            // spins). Up to twice this wait at once, or halfway down to it.
            self.budget = if twice > self.budget {
                twice
            } else {
                ((self.budget + twice) / 2).max(MIN_SPIN).min(self.limit)
            };
        } else if how == Ended::Spun {
            // Answered while spinning (a probe's answer too): the next wait
            // spins the limit, what a park costs (the ski-rental rule).
            // Spinning only about twice the usual wait, as before, parked
            // the waits between that and the limit, where a park cost 5-20
            // times the wait in the Soft-RoCE guest: 0.79-0.94x the 64 B
            // round trip's mean and 0.75-0.91x its p99 on current_thread
            // without it (benches/history/echo-2026-12-05.md, "A wait answered while
            // spinning spins the limit next").
            self.budget = self.limit;
        } else if waited <= self.limit {
            // A longer spin would have caught it.
            self.budget = self.budget.max(twice);
        } else {
            self.budget /= 2;
            if self.budget < MIN_SPIN {
                self.budget = Duration::ZERO;
            }
        }
        self.since_review = self.since_review.saturating_add(1);
        let reviewed =
            self.since_review >= LIMIT_REVIEW_WAITS && self.fresh_parked && self.fresh_spun;
        if reviewed {
            self.review_limit();
        }
        if reviewed || self.since_review >= LIMIT_REVIEW_WAITS * STALE_REVIEWS {
            // Reviewed, or no review for four periods: start afresh, so
            // an old sample never combines with one from much later.
            self.since_review = 0;
            self.fresh_parked = false;
            self.fresh_spun = false;
            self.spun_near_limit = false;
        }
    }

    /// Doubles the limit (up to `max`) when parking costs more than the
    /// limit and a spin past half the limit caught an answer, halves it
    /// (down to its start) when parking costs less than half of it; see
    /// the type's docs.
    fn review_limit(&mut self) {
        let (Some(parked), Some(spun)) = (self.parked_mean, self.spun_mean) else {
            return;
        };
        let park_cost = parked.saturating_sub(spun);
        if park_cost > self.limit && self.spun_near_limit {
            self.limit = self.limit.saturating_mul(2).min(self.max);
        } else if park_cost < self.limit / 2 {
            self.limit = (self.limit / 2).max(self.start);
            self.budget = self.budget.min(self.limit);
        }
    }
}

/// A spinning task reads the clock once per this many CQ polls (16).
///
/// In the Soft-RoCE guest a clock read is a system call and an emulated
/// HPET read (4.6-5.4 us, benches/history/echo-2026-12-01-to-03.md, "The guest's clock"), about
/// ten times an empty CQ poll there; reading it every poll delayed
/// noticing a completion by up to one read. On a host a read is ~20 ns
/// (vDSO) and an empty poll with its lock ~50-100 ns, so 16 polls
/// overshoot a deadline by at most ~1.6 us, against spin budgets of
/// [`MIN_SPIN`] (1 us) to hundreds of microseconds.
pub(crate) const POLLS_PER_CLOCK_READ: u32 = 16;

/// The end of one spin: [`SpinDeadline::passed`] reads the clock once
/// every [`POLLS_PER_CLOCK_READ`] calls, the first time after that many
/// (the wait's start was read just before the spin began, and every
/// budget is at least [`MIN_SPIN`]).
#[derive(Debug)]
pub(crate) struct SpinDeadline {
    deadline: Instant,
    polls: u32,
    /// The last clock reading and the calls made before it.
    last_read: Option<(u32, Instant)>,
}

impl SpinDeadline {
    pub(crate) fn new(deadline: Instant) -> Self {
        SpinDeadline {
            deadline,
            polls: 0,
            last_read: None,
        }
    }

    /// Whether the deadline has passed, by `now` when this call reads the
    /// clock (false between reads).
    pub(crate) fn passed(&mut self, now: impl FnOnce() -> Instant) -> bool {
        let read = self.polls > 0 && self.polls % POLLS_PER_CLOCK_READ == 0;
        self.polls = self.polls.wrapping_add(1);
        if !read {
            return false;
        }
        let t = now();
        self.last_read = Some((self.polls, t));
        t >= self.deadline
    }

    /// The time one call took, on average, from `start` (when the spin
    /// began) to the last clock reading. `None` if the spin never read
    /// the clock (it ended within [`POLLS_PER_CLOCK_READ`] calls).
    pub(crate) fn pace(&self, start: Instant) -> Option<Duration> {
        let (at, t) = self.last_read?;
        Some(t.saturating_duration_since(start) / at.max(1))
    }

    /// When the spin ended, estimated without reading the clock: its last
    /// reading plus the calls made since at [`pace`](Self::pace), or, if
    /// it never read the clock, `start` plus its calls at `fallback_pace`
    /// (an earlier spin's). `None` if neither is known.
    pub(crate) fn estimated_end(
        &self,
        start: Instant,
        fallback_pace: Option<Duration>,
    ) -> Option<Instant> {
        match (self.last_read, self.pace(start)) {
            (Some((at, t)), Some(pace)) => Some(t + pace * self.polls.saturating_sub(at)),
            _ => fallback_pace.map(|pace| start + pace * self.polls),
        }
    }
}

/// splitmix64's finaliser: spreads a connection id over 64 bits.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Within this long (1 ms) of another connection's wait ending, an
/// adaptive wait does not spin: the process has more than one connection
/// at work, and a spin would hold up the others on its thread.
pub(crate) const CONTENTION_WINDOW: Duration = Duration::from_millis(1);

/// Which connection's wait ended last, and when: one atomic word, the time
/// in microseconds since `epoch` above [`ID_BITS`] bits of connection id.
#[derive(Debug)]
pub(crate) struct RecentWaits {
    epoch: OnceLock<Instant>,
    last: AtomicU64,
}

/// Bits of the connection id kept in [`RecentWaits`] (ids equal modulo
/// 2^20 look like one connection: a heuristic, never a correctness matter).
const ID_BITS: u32 = 20;
const ID_MASK: u64 = (1 << ID_BITS) - 1;

impl RecentWaits {
    pub(crate) const fn new() -> Self {
        RecentWaits {
            epoch: OnceLock::new(),
            last: AtomicU64::new(0),
        }
    }

    fn micros(&self, at: Instant) -> u64 {
        let epoch = *self.epoch.get_or_init(|| at);
        u64::try_from(at.saturating_duration_since(epoch).as_micros()).unwrap_or(u64::MAX)
    }

    /// Connection `id`'s wait ended at `at`. The time keeps its low 44
    /// bits (about 203 days of microseconds) and is compared modulo that.
    fn ended(&self, id: u64, at: Instant) {
        let word = (self.micros(at) << ID_BITS) | (id & ID_MASK);
        self.last.store(word, Ordering::Relaxed);
    }

    /// Whether a connection other than `id` ended a wait within
    /// [`CONTENTION_WINDOW`] before `at`.
    fn others_active(&self, id: u64, at: Instant) -> bool {
        let word = self.last.load(Ordering::Relaxed);
        if word == 0 || word & ID_MASK == id & ID_MASK {
            return false;
        }
        let then = word >> ID_BITS;
        let now = self.micros(at) & (u64::MAX >> ID_BITS);
        let since = now.wrapping_sub(then) & (u64::MAX >> ID_BITS);
        since < CONTENTION_WINDOW.as_micros() as u64
    }
}

/// The CPUs this process may run on ([`std::thread::available_parallelism`]:
/// its CPU affinity and cgroup quota), read once per process; 1 if that
/// cannot be read (an unknown count is no reason to spin).
fn process_cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The strategy a connection configured with `strategy` waits by in a
/// process that may run on `cpus` CPUs: [`WaitStrategy::Adaptive`] parks
/// at once ([`WaitStrategy::Park`]) on one CPU, and every other case is
/// kept.
///
/// On one CPU a spin holds the only CPU that what it waits for needs: a
/// peer process on the same host, the kernel's Soft-RoCE work, the
/// runtime's other tasks (and on a NIC the answer's completion is no
/// sooner for the spin than for a park's wake-up by more than what a park
/// costs, which the spin takes from every other task). Measured on one
/// vCPU under QEMU icount (`echo_bench`, 64 B round trip, two processes):
/// the adaptive wait spun its probes and parked nearly every wait, 3 spin
/// hits in 5,500 waits, and ran 2.3x (current_thread) and 2.0x
/// (multi-thread) as long as parking at once. An explicit
/// [`WaitStrategy::Spin`] still spins: the caller asked for it.
pub(crate) fn for_cpus(strategy: WaitStrategy, cpus: usize) -> WaitStrategy {
    match strategy {
        WaitStrategy::Adaptive { .. } if cpus <= 1 => WaitStrategy::Park,
        other => other,
    }
}

/// The process's record of recent waits.
static PROCESS_WAITS: RecentWaits = RecentWaits::new();

/// Connection ids for [`RecentWaits`] (never 0).
static WAIT_IDS: AtomicU64 = AtomicU64::new(1);

/// One wait in progress.
#[derive(Debug, Clone, Copy)]
struct Wait {
    start: Instant,
    /// It parked (or was told not to spin by other connections' activity).
    parked: bool,
    /// It was given a budget to spin.
    spun: bool,
    /// It parked at once because other connections were at work.
    contended: bool,
    /// When a spin found what it waited for, estimated from the spin's
    /// clock readings ([`SpinDeadline::estimated_end`]).
    spun_end: Option<Instant>,
}

/// A connection's waiting state: the strategy, the learnt budget and the
/// wait in progress.
#[derive(Debug)]
pub(crate) struct SpinWait {
    strategy: WaitStrategy,
    learnt: SpinBudget,
    /// The wait in progress.
    current: Option<Wait>,
    id: u64,
    recent: &'static RecentWaits,
    /// Waits answered while spinning.
    pub(crate) spin_hits: u64,
    /// Parks (a task returned `Pending` with the CQ armed).
    pub(crate) parks: u64,
    /// The time one poll of this connection's last spin that read the
    /// clock took ([`SpinDeadline::pace`]).
    poll_pace: Option<Duration>,
}

impl SpinWait {
    /// The wait of a new connection configured with `strategy`, as
    /// [`for_cpus`] resolves it for the CPUs this process may run on.
    pub(crate) fn new(strategy: WaitStrategy) -> Self {
        Self::with_recent(for_cpus(strategy, process_cpus()), &PROCESS_WAITS)
    }

    fn with_recent(strategy: WaitStrategy, recent: &'static RecentWaits) -> Self {
        let max = match strategy {
            WaitStrategy::Adaptive { max } => max,
            _ => Duration::ZERO,
        };
        let id = WAIT_IDS.fetch_add(1, Ordering::Relaxed);
        SpinWait {
            strategy,
            learnt: SpinBudget::new(
                ADAPTIVE_SPIN_START,
                max,
                id ^ (u64::from(std::process::id()) << 32),
            ),
            current: None,
            id,
            recent,
            spin_hits: 0,
            parks: 0,
            poll_pace: None,
        }
    }

    /// A task found nothing to receive: starts a wait (or goes on with the
    /// one in progress, after a wake-up that brought nothing) and returns
    /// until when this poll may spin (`None`: park now). The park strategy
    /// reads no clock. An adaptive wait does not spin while another
    /// connection of the process ended a wait within [`CONTENTION_WINDOW`]
    /// (it is still timed, to learn from).
    pub(crate) fn begin(&mut self) -> Option<Instant> {
        let budget = match self.strategy {
            WaitStrategy::Park => return None,
            WaitStrategy::Spin(d) => d,
            WaitStrategy::Adaptive { .. } if self.current.is_some() => self.learnt.budget(),
            WaitStrategy::Adaptive { .. } => self.learnt.next_wait(),
        };
        let fresh = self.current.is_none();
        let wait = self.current.get_or_insert_with(|| Wait {
            start: Instant::now(),
            parked: false,
            spun: false,
            contended: false,
            spun_end: None,
        });
        if wait.parked || budget.is_zero() {
            return None;
        }
        if fresh
            && matches!(self.strategy, WaitStrategy::Adaptive { .. })
            && self.recent.others_active(self.id, wait.start)
        {
            wait.parked = true;
            wait.contended = true;
            return None;
        }
        wait.spun = true;
        Some(wait.start + budget)
    }

    /// The spin limit now, in microseconds: the learnt one, the fixed
    /// budget, or 0 (park).
    pub(crate) fn limit_us(&self) -> u64 {
        let limit = match self.strategy {
            WaitStrategy::Park => Duration::ZERO,
            WaitStrategy::Spin(d) => d,
            WaitStrategy::Adaptive { .. } => self.learnt.limit(),
        };
        u64::try_from(limit.as_micros()).unwrap_or(u64::MAX)
    }

    /// When the wait in progress began.
    #[cfg(test)]
    pub(crate) fn started(&self) -> Option<Instant> {
        self.current.map(|w| w.start)
    }

    /// The spin `d` of the wait in progress ended; `found`: it found what
    /// the task waits for. Then [`ready`](Self::ready) takes the wait's
    /// end from the spin's clock readings (or, for a spin too short to
    /// read the clock, from its polls at the pace an earlier spin
    /// measured) instead of reading the clock once more: in the Soft-RoCE
    /// guest a read is a system call of about 5 us, which the answer
    /// would wait for.
    pub(crate) fn spin_ended(&mut self, d: &SpinDeadline, found: bool) {
        let Some(w) = &mut self.current else {
            return;
        };
        if let Some(pace) = d.pace(w.start) {
            self.poll_pace = Some(pace);
        }
        if found && !w.parked {
            w.spun_end = d.estimated_end(w.start, self.poll_pace);
        }
    }

    /// The waiting task is about to park.
    pub(crate) fn parking(&mut self) {
        self.parks += 1;
        if let Some(w) = &mut self.current {
            w.parked = true;
        }
    }

    /// The waiting task has something to receive: ends the wait in
    /// progress, if any, and learns from it. An adaptive wait reads the
    /// clock for its end unless a spin that found the answer estimated it
    /// ([`spin_ended`](Self::spin_ended)).
    pub(crate) fn ready(&mut self) {
        if let Some(w) = self.current.take() {
            if w.spun && !w.parked {
                self.spin_hits += 1;
            }
            if matches!(self.strategy, WaitStrategy::Adaptive { .. }) {
                let now = match w.spun_end {
                    Some(end) if !w.parked => end,
                    _ => Instant::now(),
                };
                let waited = now.saturating_duration_since(w.start);
                if w.contended {
                    self.learnt.record_contended(waited);
                } else if !w.parked && crate::verbs::tasks::other_tasks_on_runtime() {
                    self.learnt.record_spun_shared(waited);
                } else {
                    self.learnt.record(waited, w.parked);
                }
                self.recent.ended(self.id, now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn on_one_cpu_the_adaptive_wait_parks_and_an_explicit_spin_is_kept() {
        let adaptive = WaitStrategy::Adaptive { max: us(1600) };
        assert_eq!(for_cpus(adaptive, 1), WaitStrategy::Park);
        assert_eq!(for_cpus(adaptive, 0), WaitStrategy::Park);
        assert_eq!(for_cpus(adaptive, 2), adaptive);
        assert_eq!(
            for_cpus(WaitStrategy::Spin(us(50)), 1),
            WaitStrategy::Spin(us(50))
        );
        assert_eq!(for_cpus(WaitStrategy::Park, 8), WaitStrategy::Park);
        // A connection on one CPU reads no clock and never spins.
        let mut w = SpinWait::with_recent(for_cpus(adaptive, 1), private_recent());
        assert_eq!(w.begin(), None);
        assert_eq!(w.started(), None);
        assert_eq!(w.limit_us(), 0);
    }

    #[test]
    fn a_spin_reads_the_clock_once_per_sixteen_polls() {
        let start = Instant::now();
        let mut d = SpinDeadline::new(start + us(100));
        let mut reads = 0u32;
        let mut clock = us(0);
        let mut passed_at = None;
        for poll in 0..40u32 {
            // The clock moves 10 us per poll.
            clock += us(10);
            if d.passed(|| {
                reads += 1;
                start + clock
            }) {
                passed_at = Some(poll);
                break;
            }
        }
        // Not at poll 0 (the wait's start was just read); at poll 16
        // (170 us >= 100 us).
        assert_eq!(reads, 1);
        assert_eq!(passed_at, Some(16));
    }

    /// `passed` called `calls` times on a clock that moves 1 us per call,
    /// from `start`.
    fn spin_calls(d: &mut SpinDeadline, start: Instant, calls: u32) -> u32 {
        let mut reads = 0;
        for i in 0..calls {
            let passed = d.passed(|| {
                reads += 1;
                start + us(u64::from(i) + 1)
            });
            assert!(!passed, "call {i}: the deadline is an hour away");
        }
        reads
    }

    #[test]
    fn a_spin_estimates_its_end_from_its_last_clock_reading() {
        let start = Instant::now();
        let hour = Duration::from_secs(3600);
        let mut d = SpinDeadline::new(start + hour);
        assert_eq!(spin_calls(&mut d, start, 16), 0);
        assert_eq!(d.estimated_end(start, None), None, "no reading yet");
        assert_eq!(d.pace(start), None);
        assert_eq!(
            d.estimated_end(start, Some(us(2))),
            Some(start + us(32)),
            "16 calls at an earlier spin's pace"
        );
        let mut d = SpinDeadline::new(start + hour);
        // Read at call 16 (17 us after the start, 17 calls made), then
        // four more calls at the same pace: 21 us.
        assert_eq!(spin_calls(&mut d, start, 21), 1);
        assert_eq!(d.pace(start), Some(us(1)));
        assert_eq!(d.estimated_end(start, Some(us(2))), Some(start + us(21)));
        let mut d = SpinDeadline::new(start + hour);
        assert_eq!(spin_calls(&mut d, start, 40), 2);
        assert_eq!(d.estimated_end(start, None), Some(start + us(40)));
    }

    /// Begins a wait of `w` and spins it `calls` polls (1 us each, no
    /// deadline reached), ended with `found`; returns the clock reads.
    fn spin_wait(w: &mut SpinWait, calls: u32, found: bool) -> u32 {
        w.begin().expect("the wait spins");
        let start = w.started().expect("a wait began");
        let mut d = SpinDeadline::new(start + Duration::from_secs(3600));
        let reads = spin_calls(&mut d, start, calls);
        w.spin_ended(&d, found);
        reads
    }

    #[test]
    fn a_wait_a_spin_answered_learns_the_spins_estimate() {
        let hour = Duration::from_secs(3600);
        let mut w = SpinWait::with_recent(WaitStrategy::Adaptive { max: hour }, private_recent());
        // A spin too short to read the clock, with no pace known yet: the
        // wait's end is read (some real time, not asserted).
        assert_eq!(spin_wait(&mut w, 5, true), 0);
        assert_eq!(w.current.map(|c| c.spun_end), Some(None));
        w.ready();
        assert_eq!((w.spin_hits, w.parks), (1, 0));
        // A spin that read the clock: its estimate, 21 us.
        w.learnt = SpinBudget::new(us(100), hour, 1);
        assert_eq!(spin_wait(&mut w, 21, true), 1);
        w.ready();
        assert_eq!(w.learnt.spun_mean, Some(us(21)));
        // A short spin now goes by that spin's pace (1 us per poll): 5 us,
        // the mean moves 1/8 of the way: 21 - 2 = 19 us.
        assert_eq!(spin_wait(&mut w, 5, true), 0);
        w.ready();
        assert_eq!(w.learnt.spun_mean, Some(us(19)));
        assert_eq!((w.spin_hits, w.parks), (3, 0));
        // A spin that ran out and parked: the wait's end is read when it
        // is ready (a parked sample, not the spin's estimate).
        spin_wait(&mut w, 21, false);
        assert_eq!(w.current.map(|c| c.spun_end), Some(None));
        w.parking();
        w.ready();
        assert_eq!((w.spin_hits, w.parks), (3, 1));
        assert_eq!(w.learnt.spun_mean, Some(us(19)));
        assert!(w.learnt.parked_mean.is_some());
    }

    #[test]
    fn with_other_tasks_on_the_runtime_a_spun_wait_teaches_twice_itself() {
        let mut b = SpinBudget::new(us(400), us(400), 1);
        assert_eq!(b.budget(), us(400));
        // Answered after 30 us: halfway down from 400 to 60 us.
        b.record_spun_shared(us(30));
        assert_eq!(b.budget(), us(230));
        b.record_spun_shared(us(30));
        assert_eq!(b.budget(), us(145));
        // Answered after 100 us, past half the budget: up to 200 us at once.
        b.record_spun_shared(us(100));
        assert_eq!(b.budget(), us(200));
        // Never past the limit.
        b.record_spun_shared(us(300));
        assert_eq!(b.budget(), us(400));
        // Alone on the runtime again: the limit after every spun wait.
        b.record_spun_shared(us(10));
        assert_eq!(b.budget(), us(210));
        b.record(us(10), false);
        assert_eq!(b.budget(), us(400));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn other_tasks_count_and_the_crates_own_do_not() {
        use crate::verbs::tasks::{OwnTask, other_tasks_on_runtime};
        assert!(!other_tasks_on_runtime(), "no task yet");
        let own = OwnTask::new();
        let task = tokio::spawn(std::future::pending::<()>());
        assert!(
            !other_tasks_on_runtime(),
            "the one task alive is counted as the crate's"
        );
        drop(own);
        assert!(other_tasks_on_runtime());
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        assert!(!other_tasks_on_runtime());
        // Inside a task, the task itself does not count.
        let inner = tokio::spawn(async { other_tasks_on_runtime() });
        assert!(!inner.await.unwrap());
    }

    #[test]
    fn outside_a_runtime_no_other_tasks() {
        assert!(!crate::verbs::tasks::other_tasks_on_runtime());
    }

    #[test]
    fn a_wait_answered_while_spinning_spins_the_limit_next() {
        let mut b = SpinBudget::new(us(50), us(50), 1);
        assert_eq!(b.budget(), us(50));
        // However soon the answer came, the next wait spins the limit.
        b.record(us(10), false);
        assert_eq!(b.budget(), us(50));
        b.record(Duration::from_nanos(100), false);
        assert_eq!(b.budget(), us(50));
        // After two waits that outlasted the limit (halved twice), one
        // answered while spinning restores it.
        b.record(us(1_000_000), true);
        b.record(us(1_000_000), true);
        assert_eq!(b.budget(), Duration::from_nanos(12_500));
        b.record(us(5), false);
        assert_eq!(b.budget(), us(50));
    }

    #[test]
    fn a_parked_wait_within_the_limit_raises_the_budget_to_twice_it() {
        let mut b = SpinBudget::new(us(50), us(50), 1);
        for _ in 0..3 {
            b.record(us(1_000_000), true);
        }
        assert_eq!(b.budget(), Duration::from_nanos(6_250));
        b.record(us(10), true);
        assert_eq!(b.budget(), us(20));
    }

    #[test]
    fn long_parked_waits_halve_the_budget_down_to_zero() {
        let mut b = SpinBudget::new(us(50), us(50), 1);
        let mut seen = Vec::new();
        for _ in 0..7 {
            b.record(us(1_000_000), true);
            seen.push(b.budget().as_nanos());
        }
        assert_eq!(
            seen,
            vec![25_000, 12_500, 6_250, 3_125, 1_562, 0, 0],
            "halved on every wait beyond max, then zero below 1 us"
        );
        // The CPU an idle connection spends spinning: the budgets it spun
        // before each long wait, 50 + 25 + 12.5 + 6.25 + 3.125 + 1.562 us.
        let spent: u128 = 50_000 + seen[..5].iter().sum::<u128>();
        assert_eq!(spent, 98_437);
    }

    #[test]
    fn a_parked_wait_within_the_limit_restores_spinning() {
        let mut b = SpinBudget::new(us(50), us(50), 1);
        for _ in 0..6 {
            b.record(us(500), true);
        }
        assert_eq!(b.budget(), Duration::ZERO);
        b.record(us(20), true);
        assert_eq!(b.budget(), us(40));
        // a parked wait never lowers a budget that is already above it
        b.record(us(5), true);
        assert_eq!(b.budget(), us(40));
        b.record(us(30), true);
        assert_eq!(b.budget(), us(50), "capped at the limit");
    }

    #[test]
    fn a_max_below_min_spin_never_spins() {
        for max in [Duration::ZERO, Duration::from_nanos(999)] {
            let mut b = SpinBudget::new(max, max, 1);
            assert_eq!(b.budget(), Duration::ZERO);
            b.record(us(1), false);
            assert_eq!(b.budget(), Duration::ZERO);
            b.record(Duration::ZERO, true);
            assert_eq!(b.budget(), Duration::ZERO);
        }
    }

    #[test]
    fn park_strategy_never_starts_a_timed_wait() {
        let mut w = SpinWait::with_recent(WaitStrategy::Park, private_recent());
        assert_eq!(w.begin(), None);
        assert_eq!(w.started(), None);
        w.parking();
        w.ready();
        assert_eq!(w.started(), None);
        assert_eq!((w.spin_hits, w.parks), (0, 1));
    }

    #[test]
    fn a_wait_spins_only_until_it_parks_and_ends_when_ready() {
        let hour = Duration::from_secs(3600);
        let mut w = SpinWait::with_recent(WaitStrategy::Spin(hour), private_recent());
        let deadline = w.begin();
        let start = w.started().expect("a wait began");
        assert_eq!(deadline, Some(start + hour));
        // a second poll of the same wait keeps its start and deadline
        assert_eq!(w.begin(), Some(start + hour));
        w.parking();
        assert_eq!(w.begin(), None, "a parked wait spins no more");
        w.ready();
        assert_eq!(w.started(), None);
        assert_eq!((w.spin_hits, w.parks), (0, 1));
        let next = w.begin();
        let start2 = w.started().expect("the next wait began");
        assert_eq!(next, Some(start2 + hour), "the next wait spins again");
        w.ready();
        assert_eq!((w.spin_hits, w.parks), (1, 1), "answered while spinning");
    }

    fn private_recent() -> &'static RecentWaits {
        Box::leak(Box::new(RecentWaits::new()))
    }

    #[test]
    fn an_adaptive_wait_does_not_spin_while_another_connection_is_active() {
        let recent = private_recent();
        let hour = Duration::from_secs(3600);
        let adaptive = WaitStrategy::Adaptive { max: hour };
        let mut a = SpinWait::with_recent(adaptive, recent);
        let mut b = SpinWait::with_recent(adaptive, recent);
        // nobody waited yet: a spins its first budget, the limit's start
        let da = a.begin();
        assert_eq!(
            da,
            Some(a.started().expect("a wait began") + ADAPTIVE_SPIN_START)
        );
        a.ready();
        // a's own ended wait does not stop a from spinning again (for the
        // budget that wait taught it)
        let da = a.begin();
        assert!(a.learnt.budget() >= MIN_SPIN);
        assert_eq!(
            da,
            Some(a.started().expect("a wait began") + a.learnt.budget())
        );
        // but it stops b (within the window), which still times its wait
        assert_eq!(b.begin(), None);
        assert!(b.started().is_some());
        assert_eq!(b.begin(), None, "the wait stays parked");
        // an explicit spin ignores other connections
        let mut c = SpinWait::with_recent(WaitStrategy::Spin(hour), recent);
        assert_eq!(c.begin(), Some(c.started().expect("a wait began") + hour));
    }

    #[test]
    fn a_zero_budget_probes_the_limit_one_wait_in_eight() {
        let mut b = SpinBudget::new(us(100), us(100), 7);
        // A learnt budget is used as it is, never replaced by a probe.
        for _ in 0..100 {
            assert_eq!(b.next_wait(), us(100));
        }
        for _ in 0..20 {
            b.record(us(1000), true);
        }
        assert_eq!(b.budget(), Duration::ZERO);
        let draws: Vec<Duration> = (0..8000).map(|_| b.next_wait()).collect();
        assert!(draws.iter().all(|d| *d == us(100) || d.is_zero()));
        let probes = draws.iter().filter(|d| !d.is_zero()).count();
        assert!(
            (800..=1200).contains(&probes),
            "{probes} probes in 8000 waits"
        );
        // A limit below MIN_SPIN never spins, probe or not.
        let mut never = SpinBudget::new(Duration::from_nanos(500), Duration::from_nanos(500), 7);
        assert!((0..1000).all(|_| never.next_wait().is_zero()));
    }

    /// Two ends of a ping-pong: a round trip takes 70 us when both spin at
    /// least that long, 300 us (both parked) otherwise. Both start parked
    /// (budget zero); probes find the fast state and both stay there.
    #[test]
    fn probes_take_two_parked_ends_of_a_ping_pong_back_to_spinning() {
        let (mut a, mut b) = (
            SpinBudget::new(us(100), us(100), 1),
            SpinBudget::new(us(100), us(100), 2),
        );
        for _ in 0..20 {
            a.record(us(300), true);
            b.record(us(300), true);
        }
        assert_eq!((a.budget(), b.budget()), (Duration::ZERO, Duration::ZERO));
        let mut fast = Vec::new();
        for _ in 0..5000 {
            let (sa, sb) = (a.next_wait(), b.next_wait());
            let both = sa >= us(70) && sb >= us(70);
            let (waited, parked) = if both {
                (us(70), false)
            } else {
                (us(300), true)
            };
            a.record(waited, parked);
            b.record(waited, parked);
            fast.push(both);
        }
        let first = fast
            .iter()
            .position(|f| *f)
            .expect("the ends never both probed");
        assert!(
            fast[first..].iter().all(|f| *f),
            "fell back to parking after round trip {first}"
        );
        assert_eq!((a.budget(), b.budget()), (us(100), us(100)));
    }

    #[test]
    fn other_connections_count_for_the_window_only() {
        let recent = private_recent();
        let t0 = Instant::now();
        assert!(!recent.others_active(7, t0), "nothing recorded yet");
        recent.ended(3, t0);
        assert!(!recent.others_active(3, t0), "its own wait");
        assert!(recent.others_active(7, t0 + Duration::from_micros(999)));
        assert!(!recent.others_active(7, t0 + CONTENTION_WINDOW));
        // ids are kept modulo 2^20
        assert!(!recent.others_active(3 + (1 << ID_BITS), t0));
    }

    #[test]
    fn adaptive_waits_teach_the_budget() {
        let mut w = SpinWait::with_recent(
            WaitStrategy::Adaptive {
                max: Duration::from_secs(3600),
            },
            private_recent(),
        );
        assert_eq!(w.learnt.budget(), ADAPTIVE_SPIN_START);
        for _ in 0..40 {
            w.begin();
            w.ready();
        }
        // forty waits answered while spinning teach the budget (within
        // its bounds); no parked wait, so no evidence that parking costs:
        // the limit stays at its start
        assert_eq!((w.spin_hits, w.parks), (40, 0));
        assert!(w.learnt.budget() <= ADAPTIVE_SPIN_START);
        assert!(w.learnt.budget() >= MIN_SPIN);
        assert_eq!(w.learnt.limit(), ADAPTIVE_SPIN_START);
        assert_eq!(w.limit_us(), 100);
    }

    /// Feeds `rounds` pairs of waits: one answered while spinning after
    /// `spun`, one parked that ended after `parked`; returns the limit
    /// after each review (every [`LIMIT_REVIEW_WAITS`] waits).
    fn limits_after(b: &mut SpinBudget, rounds: usize, spun: u64, parked: u64) -> Vec<u128> {
        let mut seen = Vec::new();
        for i in 0..rounds {
            b.record(us(spun), false);
            b.record(us(parked), true);
            if (2 * (i + 1)) % LIMIT_REVIEW_WAITS as usize == 0 {
                seen.push(b.limit().as_micros());
            }
        }
        seen
    }

    #[test]
    fn the_limit_grows_while_parking_costs_more_and_spins_past_half_of_it_catch_answers() {
        let mut b = SpinBudget::new(us(100), us(1600), 1);
        assert_eq!((b.limit(), b.budget()), (us(100), us(100)));
        // Answered in 70 us spinning, 1 ms parked: a park costs 930 us. A
        // spin past 50 us caught answers, so 100 -> 200 us; past 100 us
        // none did, so it stays there.
        assert_eq!(limits_after(&mut b, 48, 70, 1000), vec![200; 6]);
        // Answers at 150 us: 200 -> 400 us, then none past 200 us.
        assert_eq!(limits_after(&mut b, 48, 150, 1000), vec![400; 6]);
        // Answers at 300 us, parked waits of 1.5 ms: 400 -> 800 us.
        assert_eq!(limits_after(&mut b, 48, 300, 1500), vec![800; 6]);
    }

    /// The guest's ping-pong: answers spread over 20-1,400 us; one within
    /// the limit is caught spinning, a later one parks and costs 300 us
    /// more. Returns the limit after every 16 waits.
    fn spread_answers(b: &mut SpinBudget, rounds: usize, park_cost: u64) -> Vec<u128> {
        let mut seen = Vec::new();
        let mut n = 0;
        for _ in 0..rounds {
            for i in 0..64u64 {
                let answer = us(20 + (i * 37) % 1400);
                if answer <= b.limit() {
                    b.record(answer, false);
                } else {
                    b.record(answer + us(park_cost), true);
                }
                n += 1;
                if n % 16 == 0 {
                    seen.push(b.limit().as_micros());
                }
            }
        }
        seen
    }

    #[test]
    fn answers_spread_up_to_max_take_the_limit_to_max() {
        let mut b = SpinBudget::new(us(100), us(1600), 1);
        let seen = spread_answers(&mut b, 12, 300);
        assert_eq!(
            seen[..10],
            [200, 200, 200, 400, 800, 800, 800, 800, 1600, 1600]
        );
        assert!(seen[10..].iter().all(|l| *l == 1600), "{seen:?}");
        // and probes of a zero budget spin the learnt limit
        for _ in 0..20 {
            b.record(us(1_000_000), true);
        }
        assert_eq!(b.budget(), Duration::ZERO);
        assert_eq!(b.limit(), us(1600), "idle waits change no limit");
        assert!((0..64).map(|_| b.next_wait()).any(|d| d == us(1600)));
    }

    #[test]
    fn samples_from_before_an_idle_spell_do_not_combine_with_later_ones() {
        let mut b = SpinBudget::new(us(100), us(1600), 1);
        assert_eq!(limits_after(&mut b, 16, 70, 1000), vec![200; 2]);
        // One answer past half the limit, then 100 waits of an idle peer
        // (no samples, no review).
        b.record(us(150), false);
        for _ in 0..100 {
            b.record(us(10_000), true);
        }
        assert_eq!(b.limit(), us(200));
        // Fresh samples again, none past half the limit: the old one no
        // longer counts, so the limit stays.
        assert!(limits_after(&mut b, 64, 70, 1000).iter().all(|l| *l == 200));
    }

    #[test]
    fn parks_for_other_connections_are_no_sample_of_a_parks_cost() {
        let mut b = SpinBudget::new(us(100), us(1600), 1);
        for _ in 0..400 {
            b.record(us(70), false);
            b.record_contended(us(1000));
        }
        assert_eq!(b.limit(), us(100));
        assert_eq!(b.parked_mean, None);
    }

    /// Waits that never grow the limit: (answered spinning after, parked
    /// wait, what it models).
    #[test]
    fn the_limit_stays_at_its_start_where_a_park_is_cheap_or_the_peer_idle() {
        for (spun, parked, case) in [
            (3, 20, "a NIC: a park costs 17 us"),
            (
                5,
                600,
                "answers at once or after 600 us of the peer's work: the \
                 means differ by 595 us, but no spin past 50 us caught one",
            ),
            (10, 10_000, "parked waits beyond max: an idle peer"),
        ] {
            let mut b = SpinBudget::new(us(100), us(1600), 1);
            let seen = limits_after(&mut b, 1000, spun, parked);
            assert_eq!(seen.len(), 125, "{case}");
            assert!(seen.iter().all(|l| *l == 100), "{case}: {seen:?}");
        }
    }

    #[test]
    fn the_limit_falls_back_when_parking_gets_cheap() {
        let mut b = SpinBudget::new(us(100), us(1600), 1);
        spread_answers(&mut b, 12, 300);
        assert_eq!(b.limit(), us(1600));
        // Parked waits now end after 200 us, spun ones after 70 us: a park
        // costs 130 us, under half of 1,600, 800 and 400 us but not of
        // 200 us.
        let seen = limits_after(&mut b, 2000, 70, 200);
        assert_eq!(seen.last(), Some(&200));
        let mut falls: Vec<u128> = seen.clone();
        falls.dedup();
        assert_eq!(falls, vec![800, 400, 200]);
        assert!(b.budget() <= us(200));
    }

    #[test]
    fn a_max_at_or_below_the_start_is_a_fixed_limit() {
        for max in [us(50), us(100)] {
            let mut b = SpinBudget::new(us(100), max, 1);
            assert_eq!((b.budget(), b.limit()), (max, max));
            let seen = limits_after(&mut b, 200, 70, 1000);
            assert!(seen.iter().all(|l| *l == max.as_micros()), "{seen:?}");
        }
    }
}
