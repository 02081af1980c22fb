//! Registered memory pool: slabs of memory registered once as memory regions
//! (MRs) on a protection domain (PD), carved into buffers of power-of-two
//! size classes and shared by every connection on that PD.
//!
//! - [`MemoryPool`] hands out [`PoolBuf`]s: owned, `Send`, filled through
//!   [`bytes::BufMut`], frozen into [`PoolBytes`] / [`bytes::Bytes`] without
//!   copying. Memory returns to the pool when the last reference drops.
//! - [`RegisteredRegion`] registers memory the caller already has (a
//!   `Vec<u8>`, [`bytes::Bytes`] or `&'static [u8]`) for zero-copy sends.
//! - Registration goes through a crate-private `Registrar` trait: the
//!   verbs one ([`MemoryPool::for_device`]), or a fake one for the host
//!   tests. It is not public: the verbs layer binds memory windows on the
//!   `ibv_mr` a registration names, which only the crate's own
//!   registrations can vouch for.
//!
//! # Slabs, classes and the bound
//!
//! Size classes are the powers of two from
//! [`PoolConfig::min_class_size`] (default 4 KiB) to
//! [`PoolConfig::max_class_size`] (default 1 MiB); `alloc(len)` serves the
//! smallest class ≥ `len`. A slab of [`PoolConfig::slab_size`] bytes
//! (default 4 MiB) holds `slab_size / class` buffers of one class; a class
//! larger than the slab size gets a dedicated slab of exactly its size per
//! buffer. The pool never registers more than
//! [`PoolConfig::max_registered_bytes`]: when a class has no free buffer and
//! a new slab would pass the bound, slabs of other classes whose buffers are
//! all free are deregistered and freed to make room; if that is not enough
//! the pool is exhausted and [`ExhaustedPolicy`] decides between waiting and
//! [`PoolError::Exhausted`].
//!
//! # Teardown
//!
//! Every buffer keeps its slab (and the pool's free lists) alive, so a slab's
//! MR is deregistered, and only then its memory freed, once the pool and all
//! of its buffers (including every `Bytes` clone of a frozen one) are gone,
//! or when the pool reclaims a slab none of whose buffers is in use.

mod buf;

pub(crate) mod region;
mod registrar;
#[cfg(test)]
mod tests;

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::mem::ManuallyDrop;
use std::pin::pin;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tokio::sync::Notify;

pub use crate::error::PoolError;
pub use buf::{OutgoingMessage, PoolBuf, PoolBytes};
pub use region::RegisteredRegion;
pub use registrar::Access;
#[cfg(test)]
pub(crate) use registrar::FakeRegistrar;
pub(crate) use registrar::{Registrar, Registration};

use region::RegionInner;
use registrar::VerbsRegistrar;

/// Alignment of every slab (bytes). Buffers are aligned to this or to their
/// class size, whichever is smaller.
const SLAB_ALIGN: usize = 4096;

/// The "class" of a dedicated buffer ([`MemoryPool::alloc_any`] beyond the
/// largest class): its slab is freed when it drops.
const DEDICATED: usize = usize::MAX;

/// What [`MemoryPool::alloc`] does when no buffer of the class is free and
/// the bound on registered bytes forbids a new slab.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ExhaustedPolicy {
    /// Wait (asynchronously) until a buffer returns to the pool or a slab
    /// can be reclaimed. The default: exhaustion becomes back-pressure.
    #[default]
    Wait,
    /// Fail at once with [`PoolError::Exhausted`].
    Error,
}

/// Sizes and limits of a [`MemoryPool`]. `Default` gives the values
/// documented on each setter; [`MemoryPool::for_device`] checks the rules and fail with
/// [`PoolError::InvalidConfig`] when one is broken.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    min_class: usize,
    max_class: usize,
    slab_size: usize,
    max_registered_bytes: u64,
    exhausted: ExhaustedPolicy,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            min_class: 4096,
            max_class: 1 << 20,
            slab_size: 4 << 20,
            max_registered_bytes: 256 << 20,
            exhausted: ExhaustedPolicy::Wait,
        }
    }
}

impl PoolConfig {
    /// A config with the default values.
    pub fn new() -> Self {
        Self::default()
    }

    /// Smallest size class in bytes (default 4096). A power of two.
    pub fn min_class_size(mut self, bytes: usize) -> Self {
        self.min_class = bytes;
        self
    }

    /// Largest size class in bytes (default 1048576 = 1 MiB): the largest
    /// buffer [`MemoryPool::alloc`] serves. A power of two ≥ the smallest
    /// class.
    pub fn max_class_size(mut self, bytes: usize) -> Self {
        self.max_class = bytes;
        self
    }

    /// Bytes of one slab, registered as one MR and carved into buffers of
    /// one class (default 4194304 = 4 MiB). A power of two ≥ the smallest
    /// class; classes larger than this get one dedicated slab per buffer.
    pub fn slab_size(mut self, bytes: usize) -> Self {
        self.slab_size = bytes;
        self
    }

    /// The most bytes the pool registers at any time (default 268435456 =
    /// 256 MiB). At least `max(slab_size, max_class_size)`, so every class
    /// can always get a slab once the others' buffers are free. User memory
    /// registered as a [`RegisteredRegion`] does not count against it.
    pub fn max_registered_bytes(mut self, bytes: u64) -> Self {
        self.max_registered_bytes = bytes;
        self
    }

    /// The bound set by [`max_registered_bytes`](Self::max_registered_bytes),
    /// bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_registered_bytes
    }

    /// The exhaustion policy set by [`exhausted_policy`](Self::exhausted_policy).
    pub fn policy(&self) -> ExhaustedPolicy {
        self.exhausted
    }

    /// What allocation does when the pool is exhausted (default
    /// [`ExhaustedPolicy::Wait`]).
    pub fn exhausted_policy(mut self, policy: ExhaustedPolicy) -> Self {
        self.exhausted = policy;
        self
    }

    fn validate(&self) -> Result<(), PoolError> {
        let reason = if !self.min_class.is_power_of_two() {
            "min_class_size must be a power of two"
        } else if !self.max_class.is_power_of_two() || self.max_class < self.min_class {
            "max_class_size must be a power of two >= min_class_size"
        } else if !self.slab_size.is_power_of_two() || self.slab_size < self.min_class {
            "slab_size must be a power of two >= min_class_size"
        } else if self.max_registered_bytes < self.slab_size.max(self.max_class) as u64 {
            "max_registered_bytes must be >= max(slab_size, max_class_size)"
        } else {
            return Ok(());
        };
        Err(PoolError::InvalidConfig { reason })
    }
}

/// A snapshot of a pool's counters ([`MemoryPool::stats`]). Sizes are in
/// bytes; "buffer size" means its class size (its capacity), not its length.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Successful allocations since the pool was created.
    pub allocations: u64,
    /// Allocations served from a free list (a buffer that was carved before).
    pub cache_hits: u64,
    /// Allocations that needed a new slab registered.
    pub cache_misses: u64,
    /// Bytes of slab memory registered now (including slabs being
    /// registered at this moment); never above `max_registered_bytes`.
    pub bytes_registered: u64,
    /// Sum of the buffer sizes of buffers handed out and not yet returned
    /// (a frozen buffer counts until its last `Bytes` clone drops).
    pub bytes_in_use: u64,
    /// The largest `bytes_in_use` ever observed.
    pub high_water_bytes: u64,
    /// Slabs registered now.
    pub slabs: u64,
    /// Slabs deregistered and freed so far to make room for another class.
    pub slabs_released: u64,
    /// Calls to [`MemoryPool::alloc`] that found the pool exhausted and
    /// waited (each call counts once however often it was woken).
    pub waits: u64,
    /// User memory registered now: [`RegisteredRegion`]s (regions sharing
    /// a cached registration count once) and
    /// [`register_local`](MemoryPool::register_local) regions.
    pub regions: u64,
    /// Region registrations served from the registration cache.
    pub region_cache_hits: u64,
}

/// A pool of registered memory shared by every connection on one protection
/// domain. Cheap to clone (an `Arc` inside); clones share the pool.
///
/// See the [module docs](self) for slabs, size classes and the bound.
#[derive(Clone)]
pub struct MemoryPool {
    inner: Arc<PoolInner>,
}

pub(crate) struct PoolInner {
    registrar: Arc<dyn Registrar>,
    /// The device of a verbs pool (`None` for other registrars).
    device: Option<Arc<crate::verbs::rc::OpenDevice>>,
    config: PoolConfig,
    classes: Box<[Class]>,
    registered: AtomicU64,
    in_use: AtomicU64,
    high_water: AtomicU64,
    allocations: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    slabs: AtomicU64,
    slabs_released: AtomicU64,
    waits: AtomicU64,
    regions: AtomicU64,
    region_cache_hits: AtomicU64,
    /// Tasks inside `alloc` waiting for a buffer; returns skip the
    /// notification while it is zero.
    waiters: AtomicUsize,
    notify: Notify,
    /// Live slabs: start address -> length (for [`MemoryPool::owns`]).
    live_slabs: Arc<Mutex<BTreeMap<usize, usize>>>,
    /// Live read-only registrations of `Bytes`/`&'static` memory keyed by
    /// (address, length).
    region_cache: Mutex<HashMap<(usize, usize), Weak<RegionInner>>>,
}

struct Class {
    /// Buffer size (bytes).
    size: usize,
    /// Buffers per slab.
    per_slab: usize,
    /// Bytes per slab.
    slab_bytes: usize,
    free: Mutex<Vec<FreeEntry>>,
}

/// One free buffer: its slab and offset in it.
pub(crate) struct FreeEntry {
    slab: Arc<Slab>,
    offset: usize,
}

/// Zeroed, page-aligned memory registered as one MR, carved into `nbufs`
/// buffers. Exactly `nbufs` `Arc`s to it exist (one per buffer, free or
/// handed out), so it is dropped once every buffer of it is dropped.
pub(crate) struct Slab {
    // Deregistered in Drop before the memory is freed.
    reg: ManuallyDrop<Box<dyn Registration>>,
    ptr: NonNull<u8>,
    layout: Layout,
    nbufs: usize,
    /// Buffers of this slab in the class's free list; changed only under
    /// that class's lock.
    free: AtomicUsize,
    /// The pool's map of live slabs (start address -> length).
    live: Arc<Mutex<BTreeMap<usize, usize>>>,
}

// SAFETY: the slab is plain heap memory; disjoint buffer ranges of it are
// handed to one owner each (`PoolBuf`), which alone reads and writes its
// range. The registration is Send + Sync.
unsafe impl Send for Slab {}
// SAFETY: as above; `&Slab` only exposes the pointer and keys.
unsafe impl Sync for Slab {}

impl Drop for Slab {
    fn drop(&mut self) {
        lock(&self.live).remove(&(self.ptr.as_ptr() as usize));
        // SAFETY: the registration is dropped (deregistered) exactly once,
        // here, and only then the memory it covered is freed with the layout
        // it was allocated with. No buffer of the slab is alive (each held
        // an Arc to it).
        unsafe {
            ManuallyDrop::drop(&mut self.reg);
            dealloc(self.ptr.as_ptr(), self.layout);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The pool's critical sections never panic midway; recover the data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl MemoryPool {
    /// A pool registering its slabs on the protection domain of the RDMA
    /// device `device` (for example `"rxe0"` or `"mlx5_0"`), the PD every
    /// connection on that device shares. Nothing is registered until the
    /// first allocation.
    ///
    /// Errors: [`PoolError::InvalidConfig`], or [`PoolError::Device`] when the
    /// device cannot be opened (no such device, libibverbs missing).
    pub fn for_device(device: &str, config: PoolConfig) -> Result<MemoryPool, PoolError> {
        config.validate()?;
        let device =
            crate::verbs::rc::open_device(device).map_err(|e| PoolError::Device(Box::new(e)))?;
        Self::for_open_device(device, config)
    }

    /// A pool on an already opened device (for the crate's endpoints).
    pub(crate) fn for_open_device(
        device: Arc<crate::verbs::rc::OpenDevice>,
        config: PoolConfig,
    ) -> Result<MemoryPool, PoolError> {
        let mut pool = Self::with_registrar(
            VerbsRegistrar {
                device: Arc::clone(&device),
                pd: None,
            },
            config,
        )?;
        if let Some(inner) = Arc::get_mut(&mut pool.inner) {
            inner.device = Some(device);
        }
        Ok(pool)
    }

    /// A pool registering its slabs on `pd`, one connection's PD of its own
    /// on `device` (a message endpoint on a device without memory windows:
    /// its SGEs need keys of that PD). It is not on the device's shared
    /// PD: [`is_on_device`](Self::is_on_device) is false.
    pub(crate) fn for_connection_pd(
        device: Arc<crate::verbs::rc::OpenDevice>,
        pd: Arc<sideway::ibverbs::protection_domain::ProtectionDomain>,
        config: PoolConfig,
    ) -> Result<MemoryPool, PoolError> {
        Self::with_registrar(
            VerbsRegistrar {
                device,
                pd: Some(crate::verbs::fork::ParentOnly::new(pd)),
            },
            config,
        )
    }

    /// Whether the pool registers on `device`'s protection domain.
    pub(crate) fn is_on_device(&self, device: &Arc<crate::verbs::rc::OpenDevice>) -> bool {
        self.inner
            .device
            .as_ref()
            .is_some_and(|d| Arc::ptr_eq(d, device))
    }

    /// A pool registering through `registrar` (for example a
    /// `FakeRegistrar` in tests without a device). Nothing is registered
    /// until the first allocation.
    ///
    /// Errors: [`PoolError::InvalidConfig`] when `config` breaks a rule
    /// documented on [`PoolConfig`].
    pub(crate) fn with_registrar<R: Registrar>(
        registrar: R,
        config: PoolConfig,
    ) -> Result<MemoryPool, PoolError> {
        config.validate()?;
        let mut classes = Vec::new();
        let mut size = config.min_class;
        while size <= config.max_class {
            let (per_slab, slab_bytes) = if size <= config.slab_size {
                (config.slab_size / size, config.slab_size)
            } else {
                (1, size)
            };
            classes.push(Class {
                size,
                per_slab,
                slab_bytes,
                free: Mutex::new(Vec::new()),
            });
            match size.checked_mul(2) {
                Some(s) => size = s,
                None => break,
            }
        }
        Ok(MemoryPool {
            inner: Arc::new(PoolInner {
                registrar: Arc::new(registrar),
                device: None,
                config,
                classes: classes.into_boxed_slice(),
                registered: AtomicU64::new(0),
                in_use: AtomicU64::new(0),
                high_water: AtomicU64::new(0),
                allocations: AtomicU64::new(0),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                slabs: AtomicU64::new(0),
                slabs_released: AtomicU64::new(0),
                waits: AtomicU64::new(0),
                regions: AtomicU64::new(0),
                region_cache_hits: AtomicU64::new(0),
                waiters: AtomicUsize::new(0),
                notify: Notify::new(),
                region_cache: Mutex::new(HashMap::new()),
                live_slabs: Arc::new(Mutex::new(BTreeMap::new())),
            }),
        })
    }

    /// The configuration the pool was built with.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// The size class (buffer capacity in bytes) that `alloc(len)` serves:
    /// the smallest class ≥ `len` (`len` 0 gets the smallest class).
    ///
    /// Errors: [`PoolError::TooLarge`] when `len` exceeds the largest class.
    pub fn class_size(&self, len: usize) -> Result<usize, PoolError> {
        self.inner
            .class_index(len)
            .map(|i| self.inner.classes[i].size)
    }

    /// Allocates a buffer with capacity ≥ `len` (its class size) and length
    /// 0. Takes a free buffer of the class, or registers a new slab within
    /// the bound. When the pool is exhausted it waits for a buffer to return
    /// ([`ExhaustedPolicy::Wait`]) or fails ([`ExhaustedPolicy::Error`]).
    ///
    /// Errors: [`PoolError::TooLarge`], [`PoolError::Exhausted`] (Error
    /// policy only), [`PoolError::Registration`]. Cancel-safe: dropping the
    /// future loses no buffer.
    pub async fn alloc(&self, len: usize) -> Result<PoolBuf, PoolError> {
        let idx = self.inner.class_index(len)?;
        self.alloc_with(|| self.inner.try_alloc_index(idx)).await
    }

    /// Allocates a buffer for a message of `len` bytes, however large:
    /// like [`alloc`](Self::alloc) up to the largest class, beyond it a
    /// dedicated buffer of exactly `len` bytes (one MR of its own, counted
    /// against `max_registered_bytes` like a slab, deregistered and freed
    /// when the buffer drops). Exhaustion as for `alloc`.
    ///
    /// Errors: [`PoolError::TooLarge`] when `len` exceeds
    /// `max_registered_bytes` (it could never be served),
    /// [`PoolError::Exhausted`] (Error policy only),
    /// [`PoolError::Registration`]. Cancel-safe.
    pub async fn alloc_any(&self, len: usize) -> Result<PoolBuf, PoolError> {
        if len <= self.inner.config.max_class {
            return self.alloc(len).await;
        }
        self.inner.check_dedicated(len)?;
        self.alloc_with(|| self.inner.try_alloc_dedicated(len))
            .await
    }

    /// Like [`alloc_any`](Self::alloc_any) but never waits.
    pub fn try_alloc_any(&self, len: usize) -> Result<PoolBuf, PoolError> {
        if len <= self.inner.config.max_class {
            return self.try_alloc(len);
        }
        self.inner.check_dedicated(len)?;
        self.inner.try_alloc_dedicated(len)
    }

    /// Runs `attempt` until it does not report exhaustion, waiting for
    /// memory to return in between (Wait policy).
    async fn alloc_with(
        &self,
        attempt: impl Fn() -> Result<PoolBuf, PoolError>,
    ) -> Result<PoolBuf, PoolError> {
        if self.inner.config.exhausted == ExhaustedPolicy::Error {
            return attempt();
        }
        let mut waited = false;
        loop {
            match attempt() {
                Err(PoolError::Exhausted { .. }) => {}
                other => return other,
            }
            // Create the notification first (it catches every
            // `notify_waiters` from now on), then announce the waiter, then
            // look again: a buffer returned before the announcement is seen
            // by the second look, one returned after it notifies.
            let notified = pin!(self.inner.notify.notified());
            let _waiter = WaiterGuard::new(&self.inner);
            match attempt() {
                Err(PoolError::Exhausted { .. }) => {}
                other => return other,
            }
            if !waited {
                waited = true;
                self.inner.waits.fetch_add(1, Ordering::Relaxed);
            }
            notified.await;
        }
    }

    /// Like [`alloc`](Self::alloc) but never waits: an exhausted pool fails
    /// with [`PoolError::Exhausted`] whatever the policy.
    pub fn try_alloc(&self, len: usize) -> Result<PoolBuf, PoolError> {
        let idx = self.inner.class_index(len)?;
        self.inner.try_alloc_index(idx)
    }

    /// Resolves the next time memory returns to the pool (a buffer freed,
    /// a slab released). A return racing with this call can be missed, so
    /// callers also retry after a short timeout.
    pub(crate) async fn memory_returned(&self) {
        let notified = pin!(self.inner.notify.notified());
        let _waiter = WaiterGuard::new(&self.inner);
        notified.await;
    }

    /// Whether the `len` bytes at `ptr` lie inside one slab this pool has
    /// registered now: how a caller (or a test) proves that a received
    /// message sits in pool memory the NIC wrote, not in a copy.
    pub fn owns(&self, ptr: *const u8, len: usize) -> bool {
        let start = ptr as usize;
        let slabs = lock(&self.inner.live_slabs);
        slabs
            .range(..=start)
            .next_back()
            .is_some_and(|(&s, &l)| start.checked_add(len).is_some_and(|end| end <= s + l))
    }

    /// A snapshot of the pool's counters.
    pub fn stats(&self) -> PoolStats {
        let i = &self.inner;
        PoolStats {
            allocations: i.allocations.load(Ordering::Relaxed),
            cache_hits: i.hits.load(Ordering::Relaxed),
            cache_misses: i.misses.load(Ordering::Relaxed),
            bytes_registered: i.registered.load(Ordering::Relaxed),
            bytes_in_use: i.in_use.load(Ordering::Relaxed),
            high_water_bytes: i.high_water.load(Ordering::Relaxed),
            slabs: i.slabs.load(Ordering::Relaxed),
            slabs_released: i.slabs_released.load(Ordering::Relaxed),
            waits: i.waits.load(Ordering::Relaxed),
            regions: i.regions.load(Ordering::Relaxed),
            region_cache_hits: i.region_cache_hits.load(Ordering::Relaxed),
        }
    }
}

impl fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPool")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Counts a task waiting in `alloc` for as long as it lives.
struct WaiterGuard<'a>(&'a PoolInner);

impl<'a> WaiterGuard<'a> {
    fn new(pool: &'a PoolInner) -> Self {
        pool.waiters.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        WaiterGuard(pool)
    }
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

impl PoolInner {
    fn class_index(&self, len: usize) -> Result<usize, PoolError> {
        let too_large = PoolError::TooLarge {
            len,
            max_class: self.config.max_class,
        };
        if len > self.config.max_class {
            return Err(too_large);
        }
        let size = len.max(self.config.min_class).next_power_of_two();
        Ok((size.trailing_zeros() - self.config.min_class.trailing_zeros()) as usize)
    }

    fn try_alloc_index(self: &Arc<Self>, idx: usize) -> Result<PoolBuf, PoolError> {
        let class = &self.classes[idx];
        let entry = match self.pop(idx) {
            Some(e) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                e
            }
            None => match self.reserve(idx) {
                Ok(()) => match self.new_slab(idx) {
                    Ok(e) => {
                        self.misses.fetch_add(1, Ordering::Relaxed);
                        e
                    }
                    Err(e) => {
                        self.registered
                            .fetch_sub(class.slab_bytes as u64, Ordering::SeqCst);
                        self.wake_waiters();
                        return Err(e);
                    }
                },
                // A buffer may have come back while we looked elsewhere.
                Err(e) => match self.pop(idx) {
                    Some(entry) => {
                        self.hits.fetch_add(1, Ordering::Relaxed);
                        entry
                    }
                    None => return Err(e),
                },
            },
        };
        self.allocations.fetch_add(1, Ordering::Relaxed);
        let size = class.size as u64;
        let now = self.in_use.fetch_add(size, Ordering::Relaxed) + size;
        self.high_water.fetch_max(now, Ordering::Relaxed);
        Ok(PoolBuf::new(Arc::clone(self), idx, class.size, entry))
    }

    fn pop(&self, idx: usize) -> Option<FreeEntry> {
        let mut free = lock(&self.classes[idx].free);
        let e = free.pop()?;
        e.slab.free.fetch_sub(1, Ordering::Relaxed);
        Some(e)
    }

    /// Returns a buffer to its class's free list and wakes waiters.
    fn give_back(&self, idx: usize, entry: FreeEntry) {
        if idx == DEDICATED {
            let bytes = entry.slab.layout.size() as u64;
            // The only Arc of a dedicated slab: deregistered and freed here,
            // before the bound is lowered.
            drop(entry);
            self.registered.fetch_sub(bytes, Ordering::SeqCst);
            self.slabs.fetch_sub(1, Ordering::Relaxed);
            self.in_use.fetch_sub(bytes, Ordering::Relaxed);
            self.wake_waiters();
            return;
        }
        let class = &self.classes[idx];
        {
            let mut free = lock(&class.free);
            entry.slab.free.fetch_add(1, Ordering::Relaxed);
            free.push(entry);
        }
        self.in_use.fetch_sub(class.size as u64, Ordering::Relaxed);
        self.wake_waiters();
    }

    /// Wakes the tasks waiting in `alloc` (if any) after memory came back:
    /// a returned buffer or registration budget left unused.
    fn wake_waiters(&self) {
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }

    /// Reserves a slab's worth of the registration bound for class `idx`,
    /// releasing fully free slabs of other classes when the bound is hit.
    fn reserve(&self, idx: usize) -> Result<(), PoolError> {
        let bytes = self.classes[idx].slab_bytes as u64;
        self.reserve_bytes(bytes, Some(idx), self.classes[idx].size)
    }

    /// Reserves `bytes` of the registration bound, releasing fully free
    /// slabs of classes other than `except` when the bound is hit; `class`
    /// names the request in the error.
    fn reserve_bytes(
        &self,
        bytes: u64,
        except: Option<usize>,
        class: usize,
    ) -> Result<(), PoolError> {
        let max = self.config.max_registered_bytes;
        let mut cur = self.registered.load(Ordering::SeqCst);
        loop {
            if cur + bytes <= max {
                match self.registered.compare_exchange_weak(
                    cur,
                    cur + bytes,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(_) => return Ok(()),
                    Err(now) => cur = now,
                }
            } else {
                if !self.reclaim(cur + bytes - max, except) {
                    return Err(PoolError::Exhausted {
                        class,
                        max_registered_bytes: max,
                    });
                }
                cur = self.registered.load(Ordering::SeqCst);
            }
        }
    }

    /// Deregisters and frees slabs of classes other than `except` none of
    /// whose buffers is in use, until at least `need` bytes are released or
    /// none is left. Returns whether anything was released.
    fn reclaim(&self, need: u64, except: Option<usize>) -> bool {
        let mut released = 0u64;
        let mut count = 0u64;
        for (i, class) in self.classes.iter().enumerate() {
            if Some(i) == except || released >= need {
                continue;
            }
            let removed: Vec<FreeEntry> = {
                let mut free = lock(&class.free);
                let mut victims: Vec<*const Slab> = Vec::new();
                for e in free.iter() {
                    let p = Arc::as_ptr(&e.slab);
                    if released < need
                        && e.slab.free.load(Ordering::Relaxed) == e.slab.nbufs
                        && !victims.contains(&p)
                    {
                        victims.push(p);
                        released += class.slab_bytes as u64;
                    }
                }
                if victims.is_empty() {
                    continue;
                }
                count += victims.len() as u64;
                let (gone, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut *free)
                    .into_iter()
                    .partition(|e| victims.contains(&Arc::as_ptr(&e.slab)));
                *free = keep;
                gone
            };
            // Every Arc of these slabs is in `removed`: dropping it
            // deregisters and frees them before the bound is lowered.
            drop(removed);
        }
        if released > 0 {
            self.registered.fetch_sub(released, Ordering::SeqCst);
            self.slabs.fetch_sub(count, Ordering::Relaxed);
            self.slabs_released.fetch_add(count, Ordering::Relaxed);
            // A larger slab may have been freed than the caller needs.
            self.wake_waiters();
        }
        released > 0
    }

    /// Allocates and registers a slab for class `idx` (the bound is already
    /// reserved), puts all its buffers but the first in the free list and
    /// returns the first.
    fn new_slab(&self, idx: usize) -> Result<FreeEntry, PoolError> {
        let class = &self.classes[idx];
        let slab = self.register_slab(class.slab_bytes, class.per_slab)?;
        let first = FreeEntry {
            slab: Arc::clone(&slab),
            offset: 0,
        };
        if class.per_slab > 1 {
            let mut free = lock(&class.free);
            // Highest offsets first so `pop` hands out ascending addresses.
            for i in (1..class.per_slab).rev() {
                free.push(FreeEntry {
                    slab: Arc::clone(&slab),
                    offset: i * class.size,
                });
            }
            slab.free.fetch_add(class.per_slab - 1, Ordering::Relaxed);
        }
        Ok(first)
    }

    /// `len` (page-rounded) must fit the bound.
    fn check_dedicated(&self, len: usize) -> Result<(), PoolError> {
        let bytes = len.div_ceil(SLAB_ALIGN).saturating_mul(SLAB_ALIGN) as u64;
        if bytes > self.config.max_registered_bytes {
            return Err(PoolError::TooLarge {
                len,
                max_class: self.config.max_registered_bytes as usize,
            });
        }
        Ok(())
    }

    /// A dedicated buffer of `len` bytes (its slab rounded up to a page).
    fn try_alloc_dedicated(self: &Arc<Self>, len: usize) -> Result<PoolBuf, PoolError> {
        let bytes = len.div_ceil(SLAB_ALIGN).max(1) * SLAB_ALIGN;
        self.reserve_bytes(bytes as u64, None, len)?;
        let slab = match self.register_slab(bytes, 1) {
            Ok(s) => s,
            Err(e) => {
                self.registered.fetch_sub(bytes as u64, Ordering::SeqCst);
                self.wake_waiters();
                return Err(e);
            }
        };
        self.misses.fetch_add(1, Ordering::Relaxed);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        let now = self.in_use.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.high_water.fetch_max(now, Ordering::Relaxed);
        Ok(PoolBuf::new(
            Arc::clone(self),
            DEDICATED,
            len,
            FreeEntry { slab, offset: 0 },
        ))
    }

    /// Allocates and registers (read-write) `len` zeroed bytes as a slab of
    /// `nbufs` buffers, none of them in a free list yet.
    fn register_slab(&self, len: usize, nbufs: usize) -> Result<Arc<Slab>, PoolError> {
        let layout =
            Layout::from_size_align(len, SLAB_ALIGN).map_err(|e| PoolError::Registration {
                len,
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
            })?;
        // SAFETY: `layout` has non-zero size (a power of two ≥ 1).
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or(PoolError::Registration {
            len,
            source: std::io::ErrorKind::OutOfMemory.into(),
        })?;
        // SAFETY: `ptr` is valid for reads and writes of `len` bytes until
        // the Slab built below is dropped, and Slab::drop drops the
        // registration before freeing the memory.
        let reg = match unsafe { self.registrar.register(ptr, len, Access::ReadWrite) } {
            Ok(r) => r,
            Err(e) => {
                // SAFETY: allocated above with this layout; never registered.
                unsafe { dealloc(ptr.as_ptr(), layout) };
                return Err(e);
            }
        };
        self.slabs.fetch_add(1, Ordering::Relaxed);
        lock(&self.live_slabs).insert(ptr.as_ptr() as usize, len);
        Ok(Arc::new(Slab {
            reg: ManuallyDrop::new(reg),
            ptr,
            layout,
            nbufs,
            free: AtomicUsize::new(0),
            live: Arc::clone(&self.live_slabs),
        }))
    }
}
