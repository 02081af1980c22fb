//! Echo benchmark the way perftest and users run one: server and client in
//! separate processes, a closed loop of K requests of P bytes in flight on
//! one connection, the current_thread or multi-thread runtime, latency as
//! p50, mean, p99 and p99.9 (hdrhistogram), requests/s and the CPU time of
//! both processes per round trip; `suite` runs every case plus perftest on
//! the same device and prints the table with ratios.
//!
//! ```text
//! echo_bench server rdma://10.11.0.1:7700 [--runtime multi] [--wait spin:200]
//! echo_bench client rdma://10.11.0.1:7700 --size 64 --in-flight 1 --requests 20000
//! echo_bench server rdma://10.11.0.1:7701 --sink       # one way, as ib_write_bw
//! echo_bench client rdma://10.11.0.1:7701 --one-way --size 65536 --requests 5000
//! echo_bench server rdma://10.11.0.1:7702 --message --sink   # messages one way
//! echo_bench client rdma://10.11.0.1:7702 --message --one-way --size 64 [--batch 32]
//! echo_bench suite --ip 10.11.0.1 --device rxe0        # integration/bench-echo
//! ```
//!
//! `--one-way` (with a `--sink` server) is bulk the way `ib_write_bw`
//! runs it: the client writes, the server reads and drops, and the suite
//! prints MB/s and the CPU time of both processes per 10^6 bytes beside
//! `ib_write_bw -s 65536`, for the default ring (which grows up to
//! `max_ring_size`, 256 KiB), the same ring without growth
//! (`--max-ring-size 65536`) and a ring of 256 KiB from the start.
//! `--message --one-way` (with a `--message --sink` server) is the
//! message rate the way `ib_send_bw` runs it: the client sends, the server
//! takes and drops each message and reports the rate at which they
//! arrived; the suite prints 64 B messages (`send()` each and `Sink`
//! batches of 32) against `ib_send_bw -s 64`'s message rate and 1 MiB
//! messages against `ib_write_bw -s 1048576`, on both runtimes.
//! `suite --rounds N` runs those one-way tables N times, perftest in each
//! round, and prints medians, each ratio with its range over the rounds.
//! `--spawn` runs a stream client's loop in a spawned task (as a
//! service's request handler would) instead of on `block_on`'s thread;
//! the suite prints the 64 B round trip on the multi-thread runtime both
//! ways, for RDMA and for TCP.
//!
//! Addresses go through the transport switch, so `tcp://` runs the same
//! workload over the kernel's TCP. `--message` (server and client) runs it
//! over [`MessageEndpoint`] instead of a byte stream: each request is one
//! message from the pool, the server sends the very buffer it received
//! back, and the client sends each response back as its next request, so
//! neither side copies or fills a payload after the first K (rdma:// only;
//! messages above 4 KiB go by rendezvous: the receiver RDMA READs them).
//! CPU time is read from `/proc/self/stat` (user + system, all threads,
//! 10 ms ticks); runs last seconds, so the tick is below 1 % of it. Under the TCG guest every clock read is a
//! syscall (no vDSO), so each latency sample costs two syscalls that a host
//! with a vDSO clock does not pay; the syscall count leaves them out.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use hdrhistogram::Histogram;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio_rdma::transport::{Listener, Stream, TransportAddr};
use tokio_rdma::{MessageConfig, MessageEndpoint, MessageListener, RdmaConfig, WaitStrategy};

#[path = "shared/cpu.rs"]
mod cpu;
#[path = "shared/perftest.rs"]
mod perftest;
use cpu::cpu_us;
use perftest::ratio;

#[derive(Parser)]
#[command(about = "two-process echo benchmark: RdmaStream vs TCP vs perftest")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Flavor {
    /// `tokio::runtime::Builder::new_current_thread`.
    Current,
    /// `new_multi_thread` with 2 workers (what `#[tokio::main]` gives on
    /// a 2-CPU guest).
    Multi,
}

/// How `suite` counts the syscalls of both processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum SyscallCounter {
    /// The kernel's syscall tracepoints (`perf stat -e
    /// raw_syscalls:sys_enter` and one `syscalls:sys_enter_NAME` per
    /// [`PERF_SYSCALLS`] name): counted as they happen, nothing slowed.
    Perf,
    /// `strace -c -f`: every name, but each syscall stops the process.
    /// On the multi-thread runtime that slowdown itself adds futex calls
    /// (a round trip outlasts the driver's 5 ms tick, which then meets the
    /// reader on the connection's lock; benches/history/echo-2026-12-01-to-03.md, "A spin's clock
    /// reads, and the futex calls of the multi-thread runtime").
    Strace,
}

impl SyscallCounter {
    /// `me` (this binary) run under the counter, which writes to `out`.
    fn wrap(self, me: &std::path::Path, out: &std::path::Path) -> tokio::process::Command {
        match self {
            SyscallCounter::Strace => {
                let mut cmd = tokio::process::Command::new("strace");
                cmd.args(["-f", "-c", "-o"]).arg(out).arg(me);
                cmd
            }
            SyscallCounter::Perf => {
                let events = std::iter::once("raw_syscalls:sys_enter".to_string())
                    .chain(
                        PERF_SYSCALLS
                            .iter()
                            .map(|n| format!("syscalls:sys_enter_{n}")),
                    )
                    .collect::<Vec<_>>()
                    .join(",");
                let mut cmd = tokio::process::Command::new("perf");
                cmd.args(["stat", "-x,", "-e", &events, "-o"])
                    .arg(out)
                    .arg("--")
                    .arg(me);
                cmd
            }
        }
    }

    /// Ends a server started by [`SyscallCounter::wrap`] (`pid`: the
    /// counter's) so that the counter writes its figures: SIGTERM to
    /// strace, which then writes its summary; SIGINT to perf's child, the
    /// server, after which perf writes its counts.
    fn stop(self, pid: u32) {
        let _ = match self {
            SyscallCounter::Strace => std::process::Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status(),
            SyscallCounter::Perf => std::process::Command::new("pkill")
                .arg("-INT")
                .arg(format!("-P{pid}"))
                .status(),
        };
    }

    /// Calls per syscall in what the counter wrote, clock reads left out.
    fn counts(self, text: &str) -> Vec<(String, f64)> {
        match self {
            SyscallCounter::Strace => strace_counts(text),
            SyscallCounter::Perf => perf_counts(text),
        }
    }

    /// How the counts were taken, for the table's header.
    fn describe(self) -> &'static str {
        match self {
            SyscallCounter::Perf => "perf stat, syscall tracepoints",
            SyscallCounter::Strace => "strace -c -f",
        }
    }
}

/// The syscalls `--syscalls perf` counts by name (the rest is summed as
/// `other`): what a round trip of tokio and rdma-core calls.
const PERF_SYSCALLS: [&str; 16] = [
    "futex",
    "clock_gettime",
    "epoll_wait",
    "epoll_pwait",
    "read",
    "write",
    "ioctl",
    "recvfrom",
    "sendto",
    "readv",
    "writev",
    "sched_yield",
    "poll",
    "mmap",
    "munmap",
    "madvise",
];

#[derive(Subcommand)]
enum Cmd {
    /// Echo every connection until EOF. Prints `listening PORT`, then for
    /// each closed connection `closed BYTES CPU_US` (CPU time of this
    /// process so far, microseconds).
    Server {
        /// tcp://, rdma:// or auto://host:port (port 0 picks one).
        addr: TransportAddr,
        #[arg(long, value_enum, default_value = "current")]
        runtime: Flavor,
        /// How a reader waits (RdmaConfig::wait_strategy): `adaptive` (the
        /// default: a learnt limit from 100 us up to 1,600 us),
        /// `adaptive:US` (the learnt limit's `max`; 100 or less is a fixed
        /// limit), `spin:US` (a fixed busy-poll budget) or `park`.
        #[arg(long, default_value = "adaptive")]
        wait: Wait,
        /// RdmaConfig::ring_size, bytes.
        #[arg(long, default_value_t = 65536)]
        ring_size: u32,
        /// RdmaConfig::max_ring_size, bytes: the ring grows up to it under
        /// bulk (`--ring-size` or less: it never grows).
        #[arg(long, default_value_t = tokio_rdma::config::DEFAULT_MAX_RING_SIZE)]
        max_ring_size: u32,
        /// RdmaConfig::share_completion_queue (streams).
        #[arg(long)]
        share_cq: bool,
        /// Serve MessageEndpoints (echo each message) instead of streams.
        #[arg(long)]
        message: bool,
        /// Read and discard what arrives instead of echoing it (for the
        /// client's `--one-way`). With `--message`, `closed` carries two
        /// more fields: the messages received and the rate at which they
        /// arrived, messages/s from the first to the last.
        #[arg(long)]
        sink: bool,
        /// Print each closed RDMA stream's `ConnectionStats` (or message
        /// endpoint's `MessageStats`) to stderr.
        #[arg(long)]
        stats: bool,
    },
    /// One closed-loop run; prints one `result key=value ...` line.
    Client {
        addr: TransportAddr,
        /// Request (and response) bytes.
        #[arg(long, default_value_t = 64)]
        size: usize,
        /// Requests in flight.
        #[arg(long, default_value_t = 1)]
        in_flight: usize,
        /// Measured requests.
        #[arg(long, default_value_t = 20_000)]
        requests: u64,
        /// Requests before measuring (not recorded).
        #[arg(long, default_value_t = 500)]
        warmup: u64,
        #[arg(long, value_enum, default_value = "current")]
        runtime: Flavor,
        /// How a reader waits, as for the server.
        #[arg(long, default_value = "adaptive")]
        wait: Wait,
        /// RdmaConfig::ring_size, bytes.
        #[arg(long, default_value_t = 65536)]
        ring_size: u32,
        /// RdmaConfig::max_ring_size, bytes: the ring grows up to it under
        /// bulk (`--ring-size` or less: it never grows).
        #[arg(long, default_value_t = tokio_rdma::config::DEFAULT_MAX_RING_SIZE)]
        max_ring_size: u32,
        /// RdmaConfig::share_completion_queue (streams).
        #[arg(long)]
        share_cq: bool,
        /// Requests are messages on a MessageEndpoint (server `--message`).
        #[arg(long)]
        message: bool,
        /// One-way bulk (server `--sink`): `warmup + requests` writes of
        /// `size` bytes and no responses. The timed span runs from the
        /// first measured write until the server closed after the last
        /// byte (so every byte was delivered); the histogram holds each
        /// measured write's time (how long the writer waited for room).
        /// `--in-flight` does not apply. With `--message`: `warmup +
        /// requests` messages of `size` bytes, each a pool buffer filled by
        /// the client, sent with `send()` each (or `--batch`); the span ends
        /// when `flush` returned (every message taken by the server's NIC)
        /// and the histogram holds one `send()` in 16 (or each batch).
        #[arg(long)]
        one_way: bool,
        /// `--message --one-way`: send through the endpoint's `Sink` in
        /// batches of this many (`feed` each, then one `flush` posts them
        /// together); 1 calls `send()` for each message.
        #[arg(long, default_value_t = 1)]
        batch: u64,
        /// Print the RDMA stream's `ConnectionStats` (or, one way, the
        /// message endpoint's `MessageStats`) to stderr after the measured
        /// requests.
        #[arg(long)]
        stats: bool,
        /// Streams (and TCP): run the client's loop in a task it spawns,
        /// as a service's request handler would, instead of on the thread
        /// that calls `Runtime::block_on` (`#[tokio::main]`'s `main`). On
        /// the multi-thread runtime the I/O events are read by a worker,
        /// which then wakes `block_on`'s thread with a futex call; a
        /// spawned task is run by the worker that read its event.
        #[arg(long)]
        spawn: bool,
    },
    /// Every case, each in a fresh server process, plus perftest.
    Suite(SuiteArgs),
}

/// The `suite` command's arguments.
#[derive(clap::Args)]
struct SuiteArgs {
    /// IP of the RDMA interface (server and client run here).
    #[arg(long, default_value = "10.11.0.1")]
    ip: IpAddr,
    /// RDMA device for perftest.
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// GID index for perftest (`-x`): the RoCE v2 GID of `ip`.
    #[arg(long, default_value_t = 1)]
    gid_index: u32,
    /// Measured requests per 64 B case (bulk cases run a quarter).
    #[arg(long, default_value_t = 20_000)]
    requests: u64,
    /// Also count syscalls per round trip of both processes in a
    /// separate short run of the 64 B cases, with this counter.
    #[arg(long, value_enum)]
    syscalls: Option<SyscallCounter>,
    /// Same as `--syscalls strace`.
    #[arg(long, conflicts_with = "syscalls")]
    strace: bool,
    /// The servers run on this other host (two hosts on a wire):
    /// `echo_bench server` on the ports of [`remote_port`] and perftest
    /// servers on 18520 (ib_send_lat -s 64), 18521 (ib_write_bw -s
    /// 8192), 18522 (-s 65536) and 18523 (-s 1048576), restarted after
    /// each run
    /// (`integration/bench-pair-guest`). CPU is then this side's only.
    #[arg(long)]
    server_ip: Option<IpAddr>,
    /// A heading for the tables (for example the wire's condition).
    #[arg(long, default_value = "")]
    label: String,
    /// Streams and TCP only: leave the MessageEndpoint rows out (a device
    /// without memory windows, such as Soft-iWARP, has no message
    /// endpoints yet).
    #[arg(long)]
    streams_only: bool,
    /// Rounds of the one-way sections (stream bulk and messages): each
    /// round runs the perftest reference again and then every row,
    /// and each row prints the median of its rounds and its ratio as
    /// the median of the per-round ratios with their range. One run of
    /// either side moves by up to 1.7x between runs in the guest
    /// (benches/README.md, "The setups"), more than the targets' margins.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
    rounds: u32,
    /// perftest's latency and message-rate references sleep on completion
    /// events (`ib_send_lat -e`, `ib_send_bw -e`) instead of busy-polling:
    /// for one CPU (the deterministic one-vCPU setup), where a busy poller
    /// takes the CPU from its peer and rxe. `ib_write_bw` polls either way.
    #[arg(long)]
    events: bool,
    /// Also write each row's main figure and its ratio to perftest to this
    /// file, tab-separated (`table`, `row`, `value`, `unit`, `ratio` or
    /// `-`), for `integration/bench-table`.
    #[arg(long)]
    summary: Option<std::path::PathBuf>,
}

/// The rows `--summary` writes: one line each, tab-separated.
static SUMMARY: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Records one row for `--summary`: `value` in `unit`, and its ratio to
/// the table's perftest reference when it has one.
fn summarize(table: &str, row: &str, value: f64, unit: &str, ratio: Option<f64>) {
    let ratio = ratio.map_or_else(|| "-".to_string(), |r| format!("{r:.4}"));
    let line = format!("{table}\t{}\t{value:.3}\t{unit}\t{ratio}", row.trim());
    SUMMARY.lock().unwrap_or_else(|p| p.into_inner()).push(line);
}

impl SuiteArgs {
    /// The syscall counter asked for (`--syscalls`, or `--strace`).
    fn counter(&self) -> Option<SyscallCounter> {
        self.syscalls
            .or(self.strace.then_some(SyscallCounter::Strace))
    }
}

fn runtime(flavor: Flavor) -> tokio::runtime::Runtime {
    match flavor {
        Flavor::Current => tokio::runtime::Builder::new_current_thread(),
        Flavor::Multi => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(2);
            b
        }
    }
    .enable_all()
    .build()
    .expect("tokio runtime")
}

/// A `--wait` value: `park`, `spin:US`, `adaptive` or `adaptive:US`.
#[derive(Clone, Copy, Debug)]
struct Wait(WaitStrategy);

impl std::str::FromStr for Wait {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let us = |v: &str| {
            v.parse::<u64>()
                .map(Duration::from_micros)
                .map_err(|e| format!("{v}: {e}"))
        };
        Ok(Wait(match s.split_once(':') {
            None if s == "park" => WaitStrategy::Park,
            None if s == "adaptive" => WaitStrategy::default(),
            Some(("spin", v)) => WaitStrategy::Spin(us(v)?),
            Some(("adaptive", v)) => WaitStrategy::Adaptive { max: us(v)? },
            _ => {
                return Err(format!(
                    "{s}: expected park, spin:US, adaptive or adaptive:US"
                ));
            }
        }))
    }
}

fn config(wait: Wait, ring_size: u32, max_ring_size: u32, share_cq: bool) -> RdmaConfig {
    RdmaConfig::new()
        .wait_strategy(wait.0)
        .ring_size(ring_size)
        .max_ring_size(max_ring_size)
        .share_completion_queue(share_cq)
}

/// Echoes (or with `sink` reads and drops) every stream until EOF.
async fn serve(
    addr: TransportAddr,
    cfg: RdmaConfig,
    stats: bool,
    sink: bool,
) -> std::io::Result<()> {
    let listener = Listener::bind_with(&addr, &cfg).await?;
    println!("listening {}", listener.local_addr()?.port());
    loop {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        tokio::spawn(async move {
            let mut buf = vec![0u8; 256 * 1024];
            let mut total = 0u64;
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if !sink && s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        total += n as u64;
                    }
                }
            }
            if let (true, Stream::Rdma(r)) = (stats, &s) {
                eprintln!("stream closed after {total} bytes: {:?}", r.stats());
            }
            println!("closed {total} {}", cpu_us());
        });
    }
}

/// A `--sink` server times its first take and one take in this many (16):
/// its rate counts the messages between the first and the last timed take.
const SINK_TIMED_EVERY: u64 = 16;

/// Echoes every message of every endpoint (the received buffer itself)
/// until the peer closes, or with `sink` takes and drops each one; prints
/// what [`serve`] prints, and with `sink` also the messages received and
/// their rate (messages/s from the first to the last timed take, see
/// [`SINK_TIMED_EVERY`]).
async fn serve_messages(
    addr: TransportAddr,
    cfg: RdmaConfig,
    sink: bool,
    stats: bool,
) -> std::io::Result<()> {
    let cfg = MessageConfig::new().connection(cfg);
    let listener = MessageListener::bind_with(addr.host_port(), &cfg).await?;
    println!("listening {}", listener.local_addr()?.port());
    loop {
        let (ep, _) = listener.accept().await?;
        tokio::spawn(async move {
            let mut total = 0u64;
            let mut count = 0u64;
            let mut first = None;
            // The last timed take: (messages taken, when).
            let mut last = (0u64, Instant::now());
            while let Ok(Some(msg)) = ep.recv().await {
                total += msg.len() as u64;
                count += 1;
                if sink {
                    // Under the TCG guest a clock read is a syscall (no
                    // vDSO): the first take and one in SINK_TIMED_EVERY
                    // are timed, as the client times one `send()` in 16.
                    if count == 1 || count % SINK_TIMED_EVERY == 0 {
                        last = (count, Instant::now());
                        first.get_or_insert(last.1);
                    }
                } else if ep.send(msg).await.is_err() {
                    break;
                }
            }
            if stats {
                eprintln!("endpoint done after {total} bytes: {:?}", ep.stats());
            }
            let _ = ep.close().await;
            if sink {
                let span = first.map_or(0.0, |f| (last.1 - f).as_secs_f64());
                let rate = if last.0 > 1 && span > 0.0 {
                    (last.0 - 1) as f64 / span
                } else {
                    0.0
                };
                println!("closed {total} {} {count} {rate:.1}", cpu_us());
            } else {
                println!("closed {total} {}", cpu_us());
            }
        });
    }
}

/// A message client gives up (an error naming its counters) when fewer
/// than [`STALL_CHECK_EVERY`] responses came in this long: a stall is a
/// failure, not a slow figure.
const STALL: Duration = Duration::from_secs(60);

/// Responses between resets of the message client's stall guard.
const STALL_CHECK_EVERY: u64 = 256;

struct Run {
    hist: Histogram<u64>,
    secs: f64,
    cpu_us: u64,
}

/// [`closed_loop`] over a [`MessageEndpoint`]: K messages of `size` bytes in
/// flight; each response goes back as the next request (no copy, no fill).
async fn closed_loop_messages(
    addr: TransportAddr,
    cfg: RdmaConfig,
    size: usize,
    in_flight: usize,
    requests: u64,
    warmup: u64,
) -> std::io::Result<Run> {
    let ep = MessageEndpoint::connect_with(addr.host_port(), &MessageConfig::new().connection(cfg))
        .await?;
    let total = warmup + requests;
    let mut hist = Histogram::<u64>::new(3).expect("histogram");
    let mut sent = VecDeque::with_capacity(in_flight);
    let mut posted = 0u64;
    while posted < total.min(in_flight as u64) {
        let mut buf = ep.pool().alloc_any(size).await?;
        buf.spare_mut()[..size].fill(0x5a);
        buf.set_len(size);
        sent.push_back(Instant::now());
        ep.send(buf).await?;
        posted += 1;
    }
    let (mut start, mut cpu0) = (Instant::now(), cpu_us());
    // The stall guard: one timer, reset every STALL_CHECK_EVERY responses,
    // not a `timeout` per `recv` (each would read the clock inside the
    // sample, about 5 us in the TCG guest, which the stream client does
    // not pay).
    let stall = tokio::time::sleep(STALL);
    tokio::pin!(stall);
    for i in 0..total {
        if i == warmup {
            (start, cpu0) = (Instant::now(), cpu_us());
        }
        if i % STALL_CHECK_EVERY == 0 {
            stall.as_mut().reset(tokio::time::Instant::now() + STALL);
        }
        let msg = tokio::select! {
            biased;
            m = ep.recv() => m?,
            () = &mut stall => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "fewer than {STALL_CHECK_EVERY} responses in {STALL:?} after {i}; {:?}",
                        ep.stats()
                    ),
                ));
            }
        }
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("the server closed after {i} responses"),
            )
        })?;
        if msg.len() != size {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("response {i}: {} bytes, {size} sent", msg.len()),
            ));
        }
        let t = sent.pop_front().expect("a request per response");
        if i >= warmup {
            hist.record(t.elapsed().as_nanos() as u64).expect("record");
        }
        if posted < total {
            sent.push_back(Instant::now());
            ep.send(msg).await?;
            posted += 1;
        }
    }
    let run = Run {
        hist,
        secs: start.elapsed().as_secs_f64(),
        cpu_us: cpu_us() - cpu0,
    };
    ep.close().await?;
    Ok(run)
}

/// One way over a [`MessageEndpoint`] (server `--message --sink`):
/// `warmup + requests` messages of `size` bytes, each in a pool buffer the
/// client fills, sent with `send()` each or, with `batch` above 1, through
/// the `Sink` (`feed` each, one `flush` per batch). The histogram holds
/// one measured `send()` in 16 (a clock read is a syscall in the TCG
/// guest) or each measured batch; the span runs from the first measured
/// message until `flush` returned.
async fn one_way_messages(
    addr: TransportAddr,
    cfg: RdmaConfig,
    size: usize,
    batch: u64,
    requests: u64,
    warmup: u64,
    stats: bool,
) -> std::io::Result<Run> {
    use futures::SinkExt;
    let ep = MessageEndpoint::connect_with(addr.host_port(), &MessageConfig::new().connection(cfg))
        .await?;
    let batch = batch.max(1);
    // Whole batches on both sides of the warm-up's end.
    let warmup = warmup.div_ceil(batch) * batch;
    let total = warmup + requests;
    let mut hist = Histogram::<u64>::new(3).expect("histogram");
    let mut sink = ep.clone();
    let (mut start, mut cpu0) = (Instant::now(), cpu_us());
    let mut i = 0;
    while i < total {
        if i == warmup {
            (start, cpu0) = (Instant::now(), cpu_us());
        }
        let end = (i + batch).min(total);
        // Under the TCG guest a clock read is a syscall (no vDSO): a
        // `send()` each is timed one in 16, a batch always.
        let timed = i >= warmup && (batch > 1 || i % 16 == 0);
        let t = timed.then(Instant::now);
        for _ in i..end {
            let mut buf = ep.pool().alloc_any(size).await?;
            buf.spare_mut()[..size].fill(0x5a);
            buf.set_len(size);
            if batch == 1 {
                ep.send(buf).await?;
            } else {
                sink.feed(buf).await?;
            }
        }
        if batch > 1 {
            SinkExt::<tokio_rdma::PoolBuf>::flush(&mut sink).await?;
        }
        if let Some(t) = t {
            hist.record(t.elapsed().as_nanos() as u64).expect("record");
        }
        i = end;
    }
    tokio::time::timeout(STALL, ep.flush())
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("flush not done after {STALL:?}; {:?}", ep.stats()),
            )
        })??;
    let run = Run {
        hist,
        secs: start.elapsed().as_secs_f64(),
        cpu_us: cpu_us() - cpu0,
    };
    if stats {
        eprintln!("client endpoint after {total} messages: {:?}", ep.stats());
    }
    drop(sink);
    ep.close().await?;
    Ok(run)
}

/// K requests of `size` bytes in flight until `warmup + requests` came
/// back; the last `requests` are timed. `one_way`: the server is a
/// `--sink`, nothing comes back, and the timed span ends when it closed
/// after the last byte (see `--one-way`). `stats`: print the RDMA
/// stream's counters to stderr afterwards.
#[allow(clippy::too_many_arguments)]
async fn closed_loop(
    addr: TransportAddr,
    cfg: RdmaConfig,
    size: usize,
    in_flight: usize,
    one_way: bool,
    requests: u64,
    warmup: u64,
    stats: bool,
) -> std::io::Result<Run> {
    let mut s = Stream::connect_with(&addr, &cfg).await?;
    s.set_nodelay(true)?;
    let total = warmup + requests;
    let mut hist = Histogram::<u64>::new(3).expect("histogram");
    let req = vec![0x5au8; size];
    let mut resp = vec![0u8; size];
    let (mut start, mut cpu0) = (Instant::now(), cpu_us());
    if one_way {
        for i in 0..total {
            if i == warmup {
                (start, cpu0) = (Instant::now(), cpu_us());
            }
            let t = Instant::now();
            s.write_all(&req).await?;
            if i >= warmup {
                hist.record(t.elapsed().as_nanos() as u64).expect("record");
            }
        }
        // The sink closes once it has read everything: EOF means delivered.
        s.shutdown().await?;
        s.read_to_end(&mut Vec::new()).await?;
    } else if in_flight <= 1 {
        for i in 0..total {
            if i == warmup {
                (start, cpu0) = (Instant::now(), cpu_us());
            }
            let t = Instant::now();
            s.write_all(&req).await?;
            s.read_exact(&mut resp).await?;
            if i >= warmup {
                hist.record(t.elapsed().as_nanos() as u64).expect("record");
            }
        }
    } else {
        let (mut rd, mut wr) = tokio::io::split(s);
        let sent: Arc<Mutex<VecDeque<Instant>>> = Arc::default();
        let (tokens, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        for _ in 0..in_flight {
            tokens.send(()).expect("tokens");
        }
        let q = Arc::clone(&sent);
        let writer = tokio::spawn(async move {
            let mut n = 0;
            while n < total {
                if rx.recv().await.is_none() {
                    break;
                }
                q.lock().unwrap().push_back(Instant::now());
                wr.write_all(&req).await?;
                n += 1;
            }
            Ok::<_, std::io::Error>(wr)
        });
        for i in 0..total {
            if i == warmup {
                (start, cpu0) = (Instant::now(), cpu_us());
            }
            rd.read_exact(&mut resp).await?;
            let t = sent
                .lock()
                .unwrap()
                .pop_front()
                .expect("a request per response");
            if i >= warmup {
                hist.record(t.elapsed().as_nanos() as u64).expect("record");
            }
            let _ = tokens.send(());
        }
        drop(tokens);
        let wr = writer.await.expect("writer")?;
        s = rd.unsplit(wr);
    }
    let run = Run {
        hist,
        secs: start.elapsed().as_secs_f64(),
        cpu_us: cpu_us() - cpu0,
    };
    if let (true, Stream::Rdma(r)) = (stats, &s) {
        eprintln!("client stream after {total} requests: {:?}", r.stats());
    }
    if !one_way {
        s.shutdown().await?;
        s.read_to_end(&mut Vec::new()).await?;
    }
    Ok(run)
}

fn main() -> std::process::ExitCode {
    match Args::parse().cmd {
        Cmd::Server {
            addr,
            runtime: flavor,
            wait,
            ring_size,
            max_ring_size,
            share_cq,
            message,
            sink,
            stats,
        } => {
            let rt = runtime(flavor);
            let cfg = config(wait, ring_size, max_ring_size, share_cq);
            let served = if message {
                rt.block_on(serve_messages(addr, cfg, sink, stats))
            } else {
                rt.block_on(serve(addr, cfg, stats, sink))
            };
            if let Err(e) = served {
                eprintln!("echo_bench server: {e}");
                return std::process::ExitCode::FAILURE;
            }
        }
        Cmd::Client {
            addr,
            size,
            in_flight,
            requests,
            warmup,
            runtime: flavor,
            wait,
            ring_size,
            max_ring_size,
            share_cq,
            message,
            one_way,
            batch,
            stats,
            spawn,
        } => {
            let cfg = config(wait, ring_size, max_ring_size, share_cq);
            let rt = runtime(flavor);
            let run = if message && one_way {
                rt.block_on(one_way_messages(
                    addr, cfg, size, batch, requests, warmup, stats,
                ))
            } else if message {
                rt.block_on(closed_loop_messages(
                    addr, cfg, size, in_flight, requests, warmup,
                ))
            } else {
                let run = closed_loop(addr, cfg, size, in_flight, one_way, requests, warmup, stats);
                if spawn {
                    rt.block_on(
                        async move { tokio::spawn(run).await.map_err(std::io::Error::other)? },
                    )
                } else {
                    rt.block_on(run)
                }
            };
            match run {
                Ok(r) => {
                    let h = &r.hist;
                    println!(
                        "result requests={requests} warmup={warmup} secs={:.6} p50_ns={} mean_ns={:.0} p99_ns={} p999_ns={} max_ns={} cpu_us={}",
                        r.secs,
                        h.value_at_quantile(0.5),
                        h.mean(),
                        h.value_at_quantile(0.99),
                        h.value_at_quantile(0.999),
                        h.max(),
                        r.cpu_us
                    );
                }
                Err(e) => {
                    eprintln!("echo_bench client: {e}");
                    return std::process::ExitCode::FAILURE;
                }
            }
        }
        Cmd::Suite(args) => {
            let rt = runtime(Flavor::Multi);
            rt.block_on(suite(args));
        }
    }
    std::process::ExitCode::SUCCESS
}

/// One benchmark case.
#[derive(Clone)]
struct Case {
    name: &'static str,
    scheme: &'static str,
    size: usize,
    in_flight: usize,
    runtime: Flavor,
    /// The `--wait` value of both processes.
    wait: &'static str,
    ring: u32,
    /// The `--max-ring-size` of both processes.
    max_ring: u32,
    /// Over a MessageEndpoint (`--message`, rdma:// only) instead of a stream.
    message: bool,
    /// One-way bulk (`--one-way` client, `--sink` server) instead of an echo.
    one_way: bool,
    /// The client's `--batch` (message one-way cases).
    batch: u64,
    /// The client's `--spawn` (its loop in a spawned task).
    spawn: bool,
    /// Both processes run with [`VECTOR_COPIES`] (glibc copies with its
    /// vector loop, never `rep movsb`); local cases only.
    vector_copies: bool,
}

/// The `GLIBC_TUNABLES` of a [`Case::vector_copies`] row: a `rep movsb`
/// threshold no copy reaches, so glibc's `memcpy` copies with its vector
/// loop at every size. glibc takes `rep movsb` from 4 KiB (2 KiB without
/// AVX2) on a CPU with ERMS, which the guest's QEMU TCG CPU has; QEMU
/// runs `rep movsb` one byte per iteration and icount counts each
/// iteration as an instruction, so there a 64 KiB copy costs 65,536
/// instructions (65.5 us of icount guest time) against about 8 us with the
/// vector loop, while on hardware with ERMS `rep movsb` is at least as fast
/// as the vector loop. The stream's two copies per byte (the writer's into
/// the send buffer, the reader's out of the ring) are its only large
/// `memcpy`s; perftest copies nothing, so its figures do not move
/// (benches/history/copies-under-icount-2026-12-07.md).
const VECTOR_COPIES: &str = "glibc.cpu.x86_rep_movsb_threshold=4294967295";

impl Case {
    /// An echoed stream (or TCP) case with the default ring, growth up to
    /// the default maximum, and `send()` each.
    fn new(
        name: &'static str,
        scheme: &'static str,
        size: usize,
        in_flight: usize,
        runtime: Flavor,
        wait: &'static str,
    ) -> Case {
        Case {
            name,
            scheme,
            size,
            in_flight,
            runtime,
            wait,
            ring: 65536,
            max_ring: tokio_rdma::config::DEFAULT_MAX_RING_SIZE,
            message: false,
            one_way: false,
            batch: 1,
            spawn: false,
            vector_copies: false,
        }
    }
}

/// A finished case: the client's `result` fields and the server's CPU.
struct Outcome {
    p50: f64,
    mean: f64,
    p99: f64,
    p999: f64,
    rps: f64,
    cpu_per_rt_us: f64,
    /// Syscalls per round trip and the most frequent ones.
    syscalls_per_rt: Option<(f64, String)>,
    /// A message sink's rate, messages/s at the server from the first
    /// message to the last.
    server_rate: Option<f64>,
}

fn flavor_arg(f: Flavor) -> &'static str {
    match f {
        Flavor::Current => "current",
        Flavor::Multi => "multi",
    }
}

fn field(line: &str, key: &str) -> f64 {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Whether `name` reads the clock (no vDSO in the TCG guest: a host pays
/// no syscall for it, so the counts leave it out).
fn is_clock_read(name: &str) -> bool {
    matches!(name, "clock_gettime" | "gettimeofday" | "clock_getres")
}

/// Calls per syscall in an `strace -c` summary, clock reads left out.
fn strace_counts(summary: &str) -> Vec<(String, f64)> {
    summary
        .lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            // % time, seconds, usecs/call, calls, [errors], syscall
            let name = *cols.last()?;
            let calls: f64 = cols.get(3)?.parse().ok()?;
            (!is_clock_read(name) && name != "total").then(|| (name.to_string(), calls))
        })
        .collect()
}

/// Calls per syscall in `perf stat -x,` output of [`SyscallCounter::Perf`],
/// clock reads left out; the calls of names not in [`PERF_SYSCALLS`] are
/// `other` (all syscalls minus the named ones).
fn perf_counts(stat: &str) -> Vec<(String, f64)> {
    let mut all = 0.0;
    let mut named = 0.0;
    let mut counts = Vec::new();
    for l in stat.lines() {
        // count,unit,event,...; "<not counted>" lines do not parse.
        let mut cols = l.split(',');
        let (Some(count), Some(_), Some(event)) = (cols.next(), cols.next(), cols.next()) else {
            continue;
        };
        let Ok(calls) = count.parse::<f64>() else {
            continue;
        };
        if event == "raw_syscalls:sys_enter" {
            all = calls;
        } else if let Some(name) = event.strip_prefix("syscalls:sys_enter_") {
            named += calls;
            if !is_clock_read(name) && calls > 0.0 {
                counts.push((name.to_string(), calls));
            }
        }
    }
    if all > named {
        counts.push(("other".to_string(), all - named));
    }
    counts
}

/// Syscalls per round trip of both processes' counts (clock reads left
/// out): the total, and the four most frequent (`futex 3.1, write 2.0,
/// ...`).
fn syscall_profile(
    server: Vec<(String, f64)>,
    client: Vec<(String, f64)>,
    round_trips: f64,
) -> (f64, String) {
    let mut by_name: Vec<(String, f64)> = Vec::new();
    for (name, calls) in server.into_iter().chain(client) {
        match by_name.iter_mut().find(|(n, _)| *n == name) {
            Some((_, c)) => *c += calls,
            None => by_name.push((name, calls)),
        }
    }
    by_name.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total = by_name.iter().map(|(_, c)| c).sum::<f64>() / round_trips;
    let top = by_name
        .iter()
        .take(4)
        .map(|(n, c)| format!("{n} {:.1}", c / round_trips))
        .collect::<Vec<_>>()
        .join(", ");
    (total, top)
}

/// The port of the long-running server for `c` on another host: 7701
/// rdma current_thread, 7702 rdma multi-thread, 7703 rdma busy_poll 200 us,
/// 7704 tcp (7710 tcp on the multi-thread runtime), 7705 rdma
/// current_thread with a 1 MiB ring, 7706 message endpoints
/// (current_thread), 7708 and 7709 rdma current_thread and multi-thread
/// parking at once (7707 is the message bulk server of
/// `integration/bench-pair-guest`); the others wait the default way.
fn remote_port(c: &Case) -> u16 {
    if c.ring != 65536 {
        return 7705;
    }
    if c.message {
        return 7706;
    }
    match (c.scheme, c.runtime, c.wait) {
        ("tcp", Flavor::Multi, _) => 7710,
        ("tcp", _, _) => 7704,
        (_, Flavor::Current, "park") => 7708,
        (_, Flavor::Multi, "park") => 7709,
        (_, Flavor::Multi, _) => 7702,
        (_, _, "adaptive") => 7701,
        _ => 7703,
    }
}

/// `--message` for message cases, `--sink` (server) or `--one-way`
/// (client) for one-way cases, nothing for echoed streams.
fn kind_args(c: &Case, server: bool) -> &'static [&'static str] {
    match (c.message, c.one_way, server) {
        (true, true, true) => &["--message", "--sink"],
        (true, true, false) => &["--message", "--one-way"],
        (true, false, _) => &["--message"],
        (false, true, true) => &["--sink"],
        (false, true, false) => &["--one-way"],
        (false, false, _) => &[],
    }
}

/// Measured requests of an echo case of `size` bytes: a quarter of the
/// 64 B count, fewer for sizes above 64 KiB so that a case moves at most
/// as many bytes as the 64 KiB one (at least 50).
fn bulk_requests(requests: u64, size: usize) -> u64 {
    let n = (requests / 4).max(100);
    if size > 65536 {
        (n * 65536 / size as u64).max(50)
    } else {
        n
    }
}

/// Warm-up requests before `requests` measured ones of `c`: whole
/// batches (`--batch`), as the client rounds them.
fn warmup_for(c: &Case, requests: u64) -> u64 {
    500.min(requests / 4).div_ceil(c.batch.max(1)) * c.batch.max(1)
}

/// Runs `cmd` (this binary, maybe under a syscall counter) as the client of `c`
/// against `target`; returns its `result` line.
async fn run_client(
    mut cmd: tokio::process::Command,
    c: &Case,
    target: &str,
    requests: u64,
) -> Option<String> {
    let out = cmd
        .args([
            "client",
            target,
            "--size",
            &c.size.to_string(),
            "--in-flight",
            &c.in_flight.to_string(),
            "--requests",
            &requests.to_string(),
            "--warmup",
            &warmup_for(c, requests).to_string(),
            "--runtime",
            flavor_arg(c.runtime),
            "--wait",
            c.wait,
            "--ring-size",
            &c.ring.to_string(),
            "--max-ring-size",
            &c.max_ring.to_string(),
            "--batch",
            &c.batch.to_string(),
        ])
        .args(kind_args(c, false))
        .args(c.spawn.then_some("--spawn"))
        .output()
        .await
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let result = text
        .lines()
        .find(|l| l.starts_with("result "))
        .map(str::to_string);
    if result.is_none() {
        eprintln!(
            "{}: client failed: {text}{}",
            c.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    result
}

/// The figures of a client's `result` line; `server_cpu_per_rt_us` is
/// added to the client's CPU per round trip.
fn outcome(
    result: &str,
    requests: u64,
    server_cpu_per_rt_us: f64,
    syscalls_per_rt: Option<(f64, String)>,
) -> Outcome {
    Outcome {
        p50: field(result, "p50_ns") / 1e3,
        mean: field(result, "mean_ns") / 1e3,
        p99: field(result, "p99_ns") / 1e3,
        p999: field(result, "p999_ns") / 1e3,
        rps: requests as f64 / field(result, "secs"),
        cpu_per_rt_us: field(result, "cpu_us") / requests as f64 + server_cpu_per_rt_us,
        syscalls_per_rt,
        server_rate: None,
    }
}

/// Runs the client of `c` against the server for it on `peer`.
async fn run_remote_case(peer: IpAddr, c: &Case, requests: u64) -> Option<Outcome> {
    let me = std::env::current_exe().ok()?;
    let target = format!("{}://{peer}:{}", c.scheme, remote_port(c));
    let result = run_client(tokio::process::Command::new(&me), c, &target, requests).await?;
    Some(outcome(&result, requests, 0.0, None))
}

async fn run_case(
    ip: IpAddr,
    c: &Case,
    requests: u64,
    counter: Option<SyscallCounter>,
) -> Option<Outcome> {
    let me = std::env::current_exe().ok()?;
    let dir = std::env::temp_dir();
    let trace = |who: &str| dir.join(format!("echo_bench.{who}.syscalls"));
    let wrap = |who: &str| match counter {
        Some(counter) => counter.wrap(&me, &trace(who)),
        None => tokio::process::Command::new(&me),
    };
    let mut server = wrap("server");
    let mut client = wrap("client");
    if c.vector_copies {
        server.env("GLIBC_TUNABLES", VECTOR_COPIES);
        client.env("GLIBC_TUNABLES", VECTOR_COPIES);
    }
    if counter == Some(SyscallCounter::Perf) {
        // perf stat reports the SIGINT that ends the server on stderr.
        server.stderr(Stdio::null());
    }
    let mut server = server
        .args([
            "server",
            &format!("{}://{ip}:0", c.scheme),
            "--runtime",
            flavor_arg(c.runtime),
            "--wait",
            c.wait,
            "--ring-size",
            &c.ring.to_string(),
            "--max-ring-size",
            &c.max_ring.to_string(),
        ])
        .args(kind_args(c, true))
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .ok()?;
    let mut lines = BufReader::new(server.stdout.take()?).lines();
    let port = lines.next_line().await.ok()??;
    let port = port.strip_prefix("listening ")?.to_string();
    let target = format!("{}://{ip}:{port}", c.scheme);
    let result = run_client(client, c, &target, requests).await?;
    let closed = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .ok()?
        .ok()??;
    let server_cpu: f64 = closed.split_whitespace().nth(2)?.parse().ok()?;
    let server_rate = closed
        .split_whitespace()
        .nth(4)
        .and_then(|r| r.parse().ok());
    if let (Some(counter), Some(pid)) = (counter, server.id()) {
        counter.stop(pid);
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), server.wait()).await;
    let total = (requests + warmup_for(c, requests)) as f64;
    let syscalls_per_rt = counter.map(|counter| {
        let read =
            |who: &str| counter.counts(&std::fs::read_to_string(trace(who)).unwrap_or_default());
        syscall_profile(read("server"), read("client"), total)
    });
    // Client: measured requests only; server: its whole life (warm-up and
    // setup included) spread over every request it echoed.
    Some(Outcome {
        server_rate,
        ..outcome(&result, requests, server_cpu / total, syscalls_per_rt)
    })
}

async fn suite(args: SuiteArgs) {
    let counter = args.counter();
    let SuiteArgs {
        ip,
        device,
        gid_index,
        requests,
        server_ip,
        label,
        rounds,
        events,
        summary,
        streams_only,
        ..
    } = args;
    // perftest reaches an iWARP device only through rdma_cm (`-R`).
    let iwarp = tokio_rdma::verbs::device::devices().is_ok_and(|ds| {
        ds.iter().any(|d| {
            d.name == device && d.transport == tokio_rdma::verbs::device::RdmaTransport::Iwarp
        })
    });
    let run = |c: Case, n: u64| async move {
        match server_ip {
            Some(peer) => run_remote_case(peer, &c, n).await,
            None => run_case(ip, &c, n, None).await,
        }
    };
    let perf = |tool: &'static str, args: Vec<String>, port: u16| async move {
        match server_ip {
            Some(peer) => perftest::client(tool, &args, peer, port).await,
            None => perftest::run(tool, &args, ip, port).await,
        }
    };
    if !label.is_empty() {
        println!();
        println!("== {label}");
    }
    if server_ip.is_some() {
        println!(
            "(servers on {}; CPU per round trip is the client's only)",
            server_ip.unwrap_or(ip)
        );
    }
    let case = Case::new;
    use Flavor::{Current, Multi};
    let latency = [
        case(
            "RdmaStream, current_thread (default wait)",
            "rdma",
            64,
            1,
            Current,
            "adaptive",
        ),
        case(
            "RdmaStream, current_thread, park at once",
            "rdma",
            64,
            1,
            Current,
            "park",
        ),
        case(
            "RdmaStream, multi-thread (2) (default wait)",
            "rdma",
            64,
            1,
            Multi,
            "adaptive",
        ),
        case(
            "RdmaStream, multi-thread (2), park at once",
            "rdma",
            64,
            1,
            Multi,
            "park",
        ),
        // The client's loop in a spawned task, as in a service's handler,
        // instead of on `block_on`'s thread (`--spawn`).
        Case {
            spawn: true,
            ..case(
                "RdmaStream, multi-thread (2), spawned client",
                "rdma",
                64,
                1,
                Multi,
                "adaptive",
            )
        },
        case(
            "RdmaStream, current_thread, busy_poll 200 us",
            "rdma",
            64,
            1,
            Current,
            "spin:200",
        ),
        Case {
            message: true,
            ..case(
                "MessageEndpoint, current_thread",
                "rdma",
                64,
                1,
                Current,
                "adaptive",
            )
        },
        case("TCP, current_thread", "tcp", 64, 1, Current, "adaptive"),
        // tokio's own cross-thread wake-ups on this runtime: the reference
        // for the multi-thread RDMA rows (latency and syscalls).
        case("TCP, multi-thread (2)", "tcp", 64, 1, Multi, "adaptive"),
        Case {
            spawn: true,
            ..case(
                "TCP, multi-thread (2), spawned client",
                "tcp",
                64,
                1,
                Multi,
                "adaptive",
            )
        },
    ];
    let mut bulk = vec![
        case(
            "RdmaStream 8 KiB x 8, current_thread",
            "rdma",
            8192,
            8,
            Current,
            "adaptive",
        ),
        case(
            "TCP 8 KiB x 8, current_thread",
            "tcp",
            8192,
            8,
            Current,
            "adaptive",
        ),
        case(
            "RdmaStream 64 KiB x 8, current_thread",
            "rdma",
            65536,
            8,
            Current,
            "adaptive",
        ),
        case(
            "TCP 64 KiB x 8, current_thread",
            "tcp",
            65536,
            8,
            Current,
            "adaptive",
        ),
        Case {
            vector_copies: true,
            ..case(
                "RdmaStream 64 KiB x 8, current_thread, vector copies",
                "rdma",
                65536,
                8,
                Current,
                "adaptive",
            )
        },
        Case {
            message: true,
            ..case(
                "MessageEndpoint 64 KiB x 8, current_thread",
                "rdma",
                65536,
                8,
                Current,
                "adaptive",
            )
        },
        Case {
            message: true,
            ..case(
                "MessageEndpoint 1 MiB x 8, current_thread",
                "rdma",
                1 << 20,
                8,
                Current,
                "adaptive",
            )
        },
    ];
    if server_ip.is_some() {
        // A wire whose bandwidth-delay product exceeds the default ring.
        bulk.insert(
            3,
            Case {
                ring: 1 << 20,
                ..case(
                    "RdmaStream 64 KiB x 8, ring 1 MiB",
                    "rdma",
                    65536,
                    8,
                    Current,
                    "adaptive",
                )
            },
        );
    }
    // Across hosts the peer's servers run without the tunables.
    bulk.retain(|c| server_ip.is_none() || !c.vector_copies);
    // Across hosts the peer's perftest servers run with `-R` (rdma_cm picks
    // the GID for the address), as on iWARP; locally on RoCE the RoCE v2
    // GID index is given.
    let common = if iwarp || server_ip.is_some() {
        vec!["-d".to_string(), device, "-R".into(), "-F".into()]
    } else {
        vec![
            "-d".to_string(),
            device,
            "-x".into(),
            gid_index.to_string(),
            "-F".into(),
        ]
    };
    let mut lat = common.clone();
    lat.extend(["-s".into(), "64".into(), "-n".into(), requests.to_string()]);
    if events {
        lat.push("-e".into());
    }
    // ib_send_lat prints one-way times (half a round trip): doubled here.
    // Columns: #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%.
    let ib = perf("ib_send_lat", lat, 18520)
        .await
        .and_then(|o| perftest::row(&o))
        .map(|v| v.iter().map(|x| x * 2.0).collect::<Vec<f64>>());
    let ib_col = |i: usize| ib.as_ref().and_then(|v| v.get(i).copied());
    let (ib_p50, ib_mean, ib_p99, ib_p999) = (ib_col(4), ib_col(5), ib_col(7), ib_col(8));

    println!();
    println!(
        "64 B round trip, one connection, 1 in flight (us)   p50     mean      p99    p99.9     req/s  CPU us/rt  mean/ib  p99/ib"
    );
    let lat_table = "64 B round trip, mean";
    let ib_name = if events {
        "ib_send_lat -e x2 (raw verbs, events)"
    } else {
        "ib_send_lat x2 (raw verbs, busy-poll)"
    };
    match (ib_p50, ib_mean, ib_p99, ib_p999) {
        (Some(a), Some(b), Some(c), Some(d)) => {
            println!(
                "  {ib_name:<48} {a:>7.1} {b:>8.1} {c:>8.1} {d:>8.1} {:>9.0} {:>10}     1.00    1.00",
                1e6 / b,
                // Busy-polling, both perftest processes spin for the whole
                // round trip; sleeping on events, perftest does not say.
                if events {
                    "-".to_string()
                } else {
                    format!("{:.1}", 2.0 * b)
                }
            );
            summarize(lat_table, ib_name, b, "us", Some(1.0));
        }
        _ => println!("  ib_send_lat x2 (raw verbs)   n/a (perftest failed)"),
    }
    for c in latency.iter().filter(|c| !(streams_only && c.message)) {
        match run(c.clone(), requests).await {
            Some(o) => {
                println!(
                    "  {:<48} {:>7.1} {:>8.1} {:>8.1} {:>8.1} {:>9.0} {:>10.1} {:>8} {:>7}",
                    c.name,
                    o.p50,
                    o.mean,
                    o.p99,
                    o.p999,
                    o.rps,
                    o.cpu_per_rt_us,
                    ratio(o.mean, ib_mean),
                    ratio(o.p99, ib_p99)
                );
                summarize(lat_table, c.name, o.mean, "us", ib_mean.map(|b| o.mean / b));
            }
            None => println!("  {:<48} failed", c.name),
        }
    }

    println!();
    println!(
        "echo, K in flight (us)                               p50     mean      p99    p99.9     req/s  CPU us/rt  MB/s each way  vs ib_write_bw"
    );
    for c in bulk.iter().filter(|c| !(streams_only && c.message)) {
        let mut bw = common.clone();
        bw.extend(["-s".into(), c.size.to_string(), "-D".into(), "4".into()]);
        if c.size >= 1 << 20 {
            // perftest's default 128 writes in flight are 128 MiB at 1 MiB,
            // more than the guest moves in the 4 s (it then prints 0.00):
            // 8 in flight, as the echo keeps.
            bw.extend(["-t".into(), "8".into()]);
        }
        let ib_bw = if c.scheme != "tcp" {
            let port = match c.size {
                8192 => 18521,
                65536 => 18522,
                _ => 18523,
            };
            perf("ib_write_bw", bw, port)
                .await
                .and_then(|o| perftest::bw_mb_per_s(&o))
        } else {
            None
        };
        match run(c.clone(), bulk_requests(requests, c.size)).await {
            Some(o) => {
                let mbs = o.rps * c.size as f64 / 1e6;
                summarize(
                    "echo, 8 in flight, each way",
                    c.name,
                    mbs,
                    "MB/s",
                    ib_bw.map(|b| mbs / b),
                );
                println!(
                    "  {:<48} {:>7.1} {:>8.1} {:>8.1} {:>8.1} {:>9.0} {:>10.1} {:>14.2} {:>15}",
                    c.name,
                    o.p50,
                    o.mean,
                    o.p99,
                    o.p999,
                    o.rps,
                    o.cpu_per_rt_us,
                    mbs,
                    if ib_bw.is_some() {
                        format!("{} ({:.2})", ratio(mbs, ib_bw), ib_bw.unwrap_or(0.0))
                    } else {
                        "-".into()
                    }
                );
            }
            None => println!("  {:<48} failed", c.name),
        }
    }

    if server_ip.is_none() {
        // One way, as ib_write_bw runs: the client writes, the server
        // reads and drops (two processes; the peer host's servers echo, so
        // only here).
        let one_way = |name, runtime, ring| Case {
            one_way: true,
            ring,
            ..case(name, "rdma", 65536, 1, runtime, "adaptive")
        };
        let rows = [
            one_way("RdmaStream one way, current_thread", Current, 65536),
            one_way("RdmaStream one way, multi-thread (2)", Multi, 65536),
            Case {
                max_ring: 65536,
                ..one_way(
                    "RdmaStream one way, current_thread, no growth",
                    Current,
                    65536,
                )
            },
            Case {
                max_ring: 65536,
                ..one_way(
                    "RdmaStream one way, multi-thread (2), no growth",
                    Multi,
                    65536,
                )
            },
            one_way(
                "RdmaStream one way, current_thread, ring 256 KiB",
                Current,
                256 * 1024,
            ),
            one_way(
                "RdmaStream one way, multi-thread (2), ring 256 KiB",
                Multi,
                256 * 1024,
            ),
            Case {
                vector_copies: true,
                ..one_way(
                    "RdmaStream one way, current_thread, vector copies",
                    Current,
                    65536,
                )
            },
            Case {
                vector_copies: true,
                ..one_way(
                    "RdmaStream one way, multi-thread (2), vector copies",
                    Multi,
                    65536,
                )
            },
            Case {
                scheme: "tcp",
                ..one_way("TCP one way, current_thread", Current, 65536)
            },
        ];
        let mut ib = Rounds::default();
        let mut figures = vec![OneWay::default(); rows.len()];
        for _ in 0..rounds {
            let mut bw = common.clone();
            bw.extend(["-s".into(), "65536".into(), "-D".into(), "4".into()]);
            let ib_bw = perf("ib_write_bw", bw, 18522)
                .await
                .and_then(|o| perftest::bw_mb_per_s(&o));
            ib.push_opt(ib_bw);
            for (c, f) in rows.iter().zip(&mut figures) {
                let Some(o) = run(c.clone(), bulk_requests(requests, c.size)).await else {
                    f.failed += 1;
                    continue;
                };
                let mbs = o.rps * c.size as f64 / 1e6;
                f.rate.push(mbs);
                // Both processes' CPU per write, per 10^6 bytes.
                f.cpu.push(o.cpu_per_rt_us * 1e6 / c.size as f64);
                f.p50.push(o.p50);
                f.p99.push(o.p99);
                if c.scheme != "tcp" {
                    f.ratio.push_opt(ib_bw.map(|b| mbs / b));
                }
            }
        }
        println!();
        println!(
            "one way, 64 KiB writes (two processes){}                MB/s  CPU us/MB  write p50 us  write p99 us  vs ib_write_bw",
            rounds_note(rounds)
        );
        let table = "one way, 64 KiB writes";
        match ib.median() {
            Some(b) => {
                println!(
                    "  {:<48} {b:>9.2}          -             -             -  1.00{}",
                    "ib_write_bw -s 65536 (raw verbs)",
                    ib.range_of(2, " MB/s")
                );
                summarize(table, "ib_write_bw -s 65536", b, "MB/s", Some(1.0));
            }
            None => println!("  ib_write_bw -s 65536   n/a (perftest failed)"),
        }
        for (c, f) in rows.iter().zip(&figures) {
            let Some(mbs) = f.rate.median() else {
                println!("  {:<48} failed", c.name);
                continue;
            };
            let r = (c.scheme != "tcp").then(|| f.ratio.median()).flatten();
            summarize(table, c.name, mbs, "MB/s", r);
            println!(
                "  {:<48} {mbs:>9.2} {:>10.1} {:>13.1} {:>13.1}  {}{}",
                c.name,
                f.cpu.median().unwrap_or(f64::NAN),
                f.p50.median().unwrap_or(f64::NAN),
                f.p99.median().unwrap_or(f64::NAN),
                if c.scheme == "tcp" {
                    "-".into()
                } else {
                    f.ratio.ratio()
                },
                f.failures()
            );
        }
    }

    if server_ip.is_none() && !streams_only {
        message_one_way(&common, requests, rounds, events, &perf, &run).await;
    }

    if let (Some(counter), None) = (counter, server_ip) {
        println!();
        println!(
            "syscalls per round trip, both processes, clock reads left out ({}; perftest: 2); the most frequent",
            counter.describe()
        );
        for c in latency.iter().filter(|c| !(streams_only && c.message)) {
            match run_case(ip, c, 2000, Some(counter)).await {
                Some(o) => {
                    let (total, top) = o.syscalls_per_rt.unwrap_or((f64::NAN, String::new()));
                    println!("  {:<48} {total:>7.1}  {top}", c.name);
                    summarize("syscalls per round trip", c.name, total, "calls", None);
                }
                None => println!("  {:<48} failed", c.name),
            }
        }
    }
    if let Some(path) = summary {
        let rows = SUMMARY.lock().unwrap_or_else(|p| p.into_inner());
        let mut text = rows.join("\n");
        text.push('\n');
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("echo_bench: writing {}: {e}", path.display());
        }
    }
}

/// The message rows, one way as `ib_send_bw` and `ib_write_bw` run: the
/// client sends, a `--sink` server takes and drops each message; the rate
/// is taken at the server, from its first message to its last. 64 B with
/// `send()` each and through the `Sink` in batches of 32 (4 x `requests`
/// messages) against `ib_send_bw -s 64`'s message rate; 1 MiB
/// (rendezvous) against `ib_write_bw -s 1048576 -n 200`.
async fn message_one_way<P, PF, R, RF>(
    common: &[String],
    requests: u64,
    rounds: u32,
    events: bool,
    perf: &P,
    run: &R,
) where
    P: Fn(&'static str, Vec<String>, u16) -> PF,
    PF: std::future::Future<Output = Option<String>>,
    R: Fn(Case, u64) -> RF,
    RF: std::future::Future<Output = Option<Outcome>>,
{
    use Flavor::{Current, Multi};
    let row = |name, size, batch, runtime| Case {
        message: true,
        one_way: true,
        batch,
        ..Case::new(name, "rdma", size, 1, runtime, "adaptive")
    };
    let rows = [
        row(
            "MessageEndpoint 64 B, send() each, current_thread",
            64,
            1,
            Current,
        ),
        row(
            "MessageEndpoint 64 B, send() each, multi-thread (2)",
            64,
            1,
            Multi,
        ),
        row(
            "MessageEndpoint 64 B, Sink batches of 32, current_thread",
            64,
            32,
            Current,
        ),
        row(
            "MessageEndpoint 64 B, Sink batches of 32, multi-thread (2)",
            64,
            32,
            Multi,
        ),
        row(
            "MessageEndpoint 1 MiB, send() each, current_thread",
            1 << 20,
            1,
            Current,
        ),
        row(
            "MessageEndpoint 1 MiB, send() each, multi-thread (2)",
            1 << 20,
            1,
            Multi,
        ),
    ];
    let (mut ib_rates, mut ib_bws) = (Rounds::default(), Rounds::default());
    let mut figures = vec![OneWay::default(); rows.len()];
    for _ in 0..rounds {
        let mut small = common.to_vec();
        small.extend(["-s".into(), "64".into(), "-n".into(), "100000".into()]);
        if events {
            small.push("-e".into());
        }
        let ib_rate = perf("ib_send_bw", small, 18524)
            .await
            .and_then(|o| perftest::msg_rate(&o));
        let mut large = common.to_vec();
        large.extend(["-s".into(), "1048576".into(), "-n".into(), "200".into()]);
        let ib_bw = perf("ib_write_bw", large, 18525)
            .await
            .and_then(|o| perftest::bw_mb_per_s(&o));
        ib_rates.push_opt(ib_rate);
        ib_bws.push_opt(ib_bw);
        for (c, f) in rows.iter().zip(&mut figures) {
            let n = if c.size <= 64 {
                requests * 4
            } else {
                bulk_requests(requests, c.size)
            };
            let Some(o) = run(c.clone(), n).await else {
                f.failed += 1;
                continue;
            };
            let rate = o.server_rate.unwrap_or(f64::NAN);
            let mbs = rate * c.size as f64 / 1e6;
            f.rate.push(rate);
            f.cpu.push(o.cpu_per_rt_us);
            f.p50.push(o.p50 / c.batch as f64);
            f.p99.push(o.p99 / c.batch as f64);
            f.ratio.push_opt(if c.size <= 64 {
                ib_rate.map(|r| rate / r)
            } else {
                ib_bw.map(|b| mbs / b)
            });
        }
    }
    println!();
    println!(
        "messages one way (two processes){}                             msgs/s      MB/s  CPU us/msg  send p50 us  send p99 us  vs perftest",
        rounds_note(rounds)
    );
    let table = "messages one way";
    let ib_name = if events {
        "ib_send_bw -e -s 64 (raw verbs, MsgRate)"
    } else {
        "ib_send_bw -s 64 (raw verbs, MsgRate)"
    };
    match ib_rates.median() {
        Some(r) => {
            println!(
                "  {ib_name:<60} {r:>9.0} {:>9.2}           -            -            -  1.00{}",
                r * 64.0 / 1e6,
                ib_rates.range_of(0, " msgs/s")
            );
            summarize(table, ib_name, r, "msgs/s", Some(1.0));
        }
        None => println!("  ib_send_bw -s 64   n/a (perftest failed)"),
    }
    match ib_bws.median() {
        Some(b) => {
            println!(
                "  {:<60} {:>9.1} {b:>9.2}           -            -            -  1.00{}",
                "ib_write_bw -s 1048576 (raw verbs)",
                b * 1e6 / (1 << 20) as f64,
                ib_bws.range_of(2, " MB/s")
            );
            summarize(table, "ib_write_bw -s 1048576", b, "MB/s", Some(1.0));
        }
        None => println!("  ib_write_bw -s 1048576   n/a (perftest failed)"),
    }
    for (c, f) in rows.iter().zip(&figures) {
        let Some(rate) = f.rate.median() else {
            println!("  {:<60} failed", c.name);
            continue;
        };
        if c.size <= 64 {
            summarize(table, c.name, rate, "msgs/s", f.ratio.median());
        } else {
            summarize(
                table,
                c.name,
                rate * c.size as f64 / 1e6,
                "MB/s",
                f.ratio.median(),
            );
        }
        println!(
            "  {:<60} {rate:>9.0} {:>9.2} {:>11.1} {:>12.1} {:>12.1}  {}{}",
            c.name,
            rate * c.size as f64 / 1e6,
            f.cpu.median().unwrap_or(f64::NAN),
            f.p50.median().unwrap_or(f64::NAN),
            f.p99.median().unwrap_or(f64::NAN),
            f.ratio.ratio(),
            f.failures()
        );
    }
}

/// One figure over the suite's `--rounds`: the value of each round that
/// produced one, printed as their median and, over two rounds or more,
/// their range.
#[derive(Debug, Default, Clone)]
struct Rounds(Vec<f64>);

impl Rounds {
    /// Records a round's value (a NaN, from a run that reported none, is
    /// left out).
    fn push(&mut self, v: f64) {
        if !v.is_nan() {
            self.0.push(v);
        }
    }

    fn push_opt(&mut self, v: Option<f64>) {
        if let Some(v) = v {
            self.push(v);
        }
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    /// The median (of an even count, the mean of the middle two); `None`
    /// without values.
    fn median(&self) -> Option<f64> {
        let v = self.sorted();
        let n = v.len();
        match n {
            0 => None,
            _ if n % 2 == 1 => Some(v[n / 2]),
            _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
        }
    }

    /// `" (min-max)"` to two places over two values or more, else empty.
    fn range(&self) -> String {
        self.range_of(2, "")
    }

    /// `" (min-max UNIT)"` to `places` decimals over two values or more,
    /// else empty: a reference's own spread over the rounds.
    fn range_of(&self, places: usize, unit: &str) -> String {
        let v = self.sorted();
        match (v.first(), v.last()) {
            (Some(lo), Some(hi)) if v.len() > 1 => {
                format!(" ({lo:.places$}-{hi:.places$}{unit})")
            }
            _ => String::new(),
        }
    }

    /// A ratio's median to two places with its range, or `n/a`.
    fn ratio(&self) -> String {
        match self.median() {
            Some(m) => format!("{m:.2}{}", self.range()),
            None => "n/a".into(),
        }
    }
}

/// A one-way row's figures over the rounds.
#[derive(Debug, Default, Clone)]
struct OneWay {
    /// MB/s (stream) or messages/s (messages).
    rate: Rounds,
    /// CPU us per 10^6 bytes (stream) or per message (messages).
    cpu: Rounds,
    p50: Rounds,
    p99: Rounds,
    /// Against that round's perftest reference.
    ratio: Rounds,
    /// Rounds whose run failed.
    failed: u32,
}

impl OneWay {
    /// `", N rounds failed"` when some did, else empty.
    fn failures(&self) -> String {
        match self.failed {
            0 => String::new(),
            n => format!(", {n} rounds failed"),
        }
    }
}

/// The one-way tables' heading note: empty for one round.
fn rounds_note(rounds: u32) -> String {
    if rounds > 1 {
        format!(", medians of {rounds} rounds")
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A median of an odd and of an even count, NaNs and missing values
    /// left out, the range only over two values or more, `n/a` without
    /// any.
    #[test]
    fn rounds_print_the_median_and_the_range() {
        let mut r = Rounds::default();
        assert_eq!(r.median(), None);
        assert_eq!(r.ratio(), "n/a");
        assert_eq!(r.range(), "");
        r.push(1.0);
        assert_eq!(r.ratio(), "1.00");
        r.push(f64::NAN);
        r.push_opt(None);
        r.push(0.5);
        r.push_opt(Some(2.0));
        assert_eq!(r.median(), Some(1.0));
        assert_eq!(r.ratio(), "1.00 (0.50-2.00)");
        r.push(1.5);
        assert_eq!(r.median(), Some(1.25));
        assert_eq!(r.range(), " (0.50-2.00)");
        assert_eq!(r.range_of(0, " msgs/s"), " (0-2 msgs/s)");
        assert_eq!(rounds_note(1), "");
        assert_eq!(rounds_note(3), ", medians of 3 rounds");
    }

    /// `perf stat -x,` lines: clock reads left out, names not counted one
    /// by one summed as `other`, "<not counted>" skipped.
    #[test]
    fn perf_counts_leave_clock_reads_out_and_sum_the_rest_as_other() {
        let stat = "# started on Thu Dec  3\n\n\
            1300,,raw_syscalls:sys_enter,1000,100.00,,\n\
            200,,syscalls:sys_enter_futex,1000,100.00,,\n\
            700,,syscalls:sys_enter_clock_gettime,1000,100.00,,\n\
            100,,syscalls:sys_enter_write,1000,100.00,,\n\
            0,,syscalls:sys_enter_poll,1000,100.00,,\n\
            <not counted>,,syscalls:sys_enter_readv,0,0.00,,\n";
        assert_eq!(
            perf_counts(stat),
            vec![
                ("futex".to_string(), 200.0),
                ("write".to_string(), 100.0),
                ("other".to_string(), 300.0),
            ]
        );
    }

    /// perftest's bandwidth column is MiB/s; the reference is in 10^6
    /// bytes/s. No result row: no figure.
    #[test]
    fn ib_write_bw_output_gives_mb_per_s() {
        let out = "---\n #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
            65536      1968             0.00               40.98  \t\t   0.000656\n---\n";
        assert_eq!(perftest::bw_mb_per_s(out), Some(40.98 * 1.048576));
        assert_eq!(
            perftest::bw_mb_per_s("Couldn't connect to 10.11.0.1\n"),
            None
        );
    }

    /// `ib_send_bw`'s MsgRate column (Mpps) in messages/s.
    #[test]
    fn ib_send_bw_output_gives_messages_per_s() {
        let out = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
            64         100000           2.72               2.70   \t\t   0.044166\n";
        assert_eq!(perftest::msg_rate(out), Some(0.044166 * 1e6));
        assert_eq!(perftest::msg_rate("no result\n"), None);
    }

    /// Both processes' counts add up per name, per round trip.
    #[test]
    fn a_profile_adds_both_processes_per_round_trip() {
        let strace = "% time     seconds  usecs/call     calls    errors syscall\n\
            ------ ----------- ----------- --------- --------- ----------------\n \
            60.00    0.006000           3      2000           futex\n \
            30.00    0.003000           1      3000           clock_gettime\n \
            10.00    0.001000           1      1000       500 read\n\
            ------ ----------- ----------- --------- --------- ----------------\n\
            100.00    0.010000           1      6000       500 total\n";
        let client = strace_counts(strace);
        assert_eq!(
            client,
            vec![("futex".to_string(), 2000.0), ("read".to_string(), 1000.0)]
        );
        let server = vec![("read".to_string(), 3000.0), ("other".to_string(), 1000.0)];
        let (total, top) = syscall_profile(server, client, 1000.0);
        assert_eq!(total, 7.0);
        assert_eq!(top, "read 4.0, futex 2.0, other 1.0");
    }
}
