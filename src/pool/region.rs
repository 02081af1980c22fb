//! [`RegisteredRegion`]: memory the caller already has, registered for
//! zero-copy sends.

use std::any::Any;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use bytes::Bytes;

use super::{Access, MemoryPool, PoolError, PoolInner, Registration, lock};

/// Memory the caller already had (a `Vec<u8>`, [`Bytes`] or
/// `&'static [u8]`), registered as a read-only memory region
/// ([`Access::ReadOnly`]: the NIC reads it for sends and peers may RDMA READ
/// it; nothing writes it) on the pool's protection domain.
///
/// The region owns the memory (the `Vec` or a `Bytes` clone), so the MR can
/// never outlive it: dropping the last clone deregisters the MR, then frees
/// the memory. Cheap to clone (an `Arc` inside); derefs to the registered
/// bytes.
///
/// Made by [`MemoryPool::register_vec`], [`MemoryPool::register_bytes`] and
/// [`MemoryPool::register_static`]. The latter two share one registration
/// among live regions of the same (address, length): a repeated send of the
/// same `Bytes` or static data registers once.
#[derive(Clone)]
pub struct RegisteredRegion {
    inner: Arc<RegionInner>,
}

pub(crate) struct RegionInner {
    // Deregistered in Drop, before `storage` frees the memory.
    reg: ManuallyDrop<Box<dyn Registration>>,
    ptr: NonNull<u8>,
    len: usize,
    #[allow(dead_code)] // owns the memory; read through `ptr`
    storage: Storage,
    pool: Weak<PoolInner>,
    cached: bool,
}

#[allow(dead_code)] // the fields only keep the memory alive
enum Storage {
    Vec(Vec<u8>),
    Bytes(Bytes),
    Static(&'static [u8]),
}

// SAFETY: the region only reads its memory, which it owns (Vec, Bytes) or
// which is 'static and immutable; the registration is Send + Sync.
unsafe impl Send for RegionInner {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for RegionInner {}

impl Drop for RegionInner {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.regions.fetch_sub(1, Ordering::Relaxed);
            if self.cached {
                let mut cache = lock(&pool.region_cache);
                let key = (self.ptr.as_ptr() as usize, self.len);
                // Another live region may have replaced our dead entry.
                if cache.get(&key).is_some_and(|w| w.strong_count() == 0) {
                    cache.remove(&key);
                }
            }
        }
        // SAFETY: dropped exactly once, here, before `storage` (dropped
        // after this function returns) frees the memory it covers.
        unsafe { ManuallyDrop::drop(&mut self.reg) };
    }
}

impl RegisteredRegion {
    /// Virtual address of the first byte.
    pub fn addr(&self) -> u64 {
        self.inner.ptr.as_ptr() as u64
    }

    /// Length in bytes (> 0).
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Always false: empty memory cannot be registered.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Local key of the memory region.
    pub fn lkey(&self) -> u32 {
        self.inner.reg.lkey()
    }

    /// Remote key of the memory region. It opens nothing to a peer: a
    /// rendezvous binds a memory window over exactly the message.
    pub fn rkey(&self) -> u32 {
        self.inner.reg.rkey()
    }

    /// The `ibv_mr` address, 0 for fakes.
    pub(crate) fn raw_mr(&self) -> usize {
        self.inner.reg.raw_mr()
    }

    /// Whether a rendezvous can expose this region through a memory window
    /// (false for read-only pages, such as a `&'static` in `.rodata`: the
    /// kernel pins memory for window binding writable). A message endpoint
    /// copies such a region into a pool buffer when it is too large to go
    /// eagerly.
    pub fn can_bind_windows(&self) -> bool {
        self.inner.reg.can_bind_windows()
    }

    /// The registered bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is memory the region owns (or 'static),
        // initialized and never written while the region lives.
        unsafe { std::slice::from_raw_parts(self.inner.ptr.as_ptr(), self.inner.len) }
    }

    /// The registered bytes as [`Bytes`] without copying (its pointer is
    /// [`addr`](Self::addr)); the registration lives until the last clone
    /// drops.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl Deref for RegisteredRegion {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for RegisteredRegion {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for RegisteredRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .finish()
    }
}

impl MemoryPool {
    /// Registers `data` (read-only) for zero-copy sends; the region owns the
    /// `Vec`. Never shared through the registration cache (the `Vec` is
    /// uniquely owned).
    ///
    /// Errors: [`PoolError::EmptyRegion`] for an empty `Vec`,
    /// [`PoolError::Registration`] when the provider refuses.
    pub fn register_vec(&self, data: Vec<u8>) -> Result<RegisteredRegion, PoolError> {
        let (ptr, len) = (data.as_ptr(), data.len());
        self.register_storage(ptr, len, Storage::Vec(data), false)
    }

    /// Registers `data` (read-only) for zero-copy sends; the region keeps a
    /// clone of it. While a region of the same address and length is alive,
    /// its registration is shared (a cache hit in [`PoolStats`](super::PoolStats)).
    ///
    /// Errors: [`PoolError::EmptyRegion`], [`PoolError::Registration`].
    pub fn register_bytes(&self, data: Bytes) -> Result<RegisteredRegion, PoolError> {
        let (ptr, len) = (data.as_ptr(), data.len());
        self.register_storage(ptr, len, Storage::Bytes(data), true)
    }

    /// Registers static data (read-only, so `.rodata` works) for zero-copy
    /// sends, sharing the registration with live regions of the same address
    /// and length like [`register_bytes`](Self::register_bytes).
    ///
    /// Errors: [`PoolError::EmptyRegion`], [`PoolError::Registration`].
    pub fn register_static(&self, data: &'static [u8]) -> Result<RegisteredRegion, PoolError> {
        self.register_storage(data.as_ptr(), data.len(), Storage::Static(data), true)
    }

    fn register_storage(
        &self,
        ptr: *const u8,
        len: usize,
        storage: Storage,
        cache: bool,
    ) -> Result<RegisteredRegion, PoolError> {
        if len == 0 {
            return Err(PoolError::EmptyRegion);
        }
        let ptr = NonNull::new(ptr.cast_mut()).ok_or(PoolError::EmptyRegion)?;
        let pool = &self.inner;
        let key = (ptr.as_ptr() as usize, len);
        // Held across registration so two callers of the same key share one.
        let mut guard = cache.then(|| lock(&pool.region_cache));
        if let Some(inner) = guard.as_ref().and_then(|c| c.get(&key)?.upgrade()) {
            // A live region owns memory at exactly this address and length,
            // so it is the same memory (and `storage`, a second owner of it,
            // can be dropped).
            pool.region_cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(RegisteredRegion { inner });
        }
        // SAFETY: `ptr..ptr+len` is readable and stays valid and unwritten
        // until the registration is dropped: `storage` owns (or borrows
        // 'static) that memory and RegionInner::drop drops the registration
        // before `storage`. Read-only access: the NIC never writes it.
        let reg = unsafe { pool.registrar.register(ptr, len, Access::ReadOnly) }?;
        pool.regions.fetch_add(1, Ordering::Relaxed);
        let inner = Arc::new(RegionInner {
            reg: ManuallyDrop::new(reg),
            ptr,
            len,
            storage,
            pool: Arc::downgrade(pool),
            cached: cache,
        });
        if let Some(c) = guard.as_mut() {
            c.insert(key, Arc::downgrade(&inner));
        }
        drop(guard);
        Ok(RegisteredRegion { inner })
    }
}

/// Memory of the caller's registered writable for remote access through
/// grants: the backing of a [`LocalRegion`](crate::remote::LocalRegion)
/// made by [`MemoryPool::register_local`]. It owns the memory (boxed, so
/// its bytes never move) and deregisters the MR before freeing it.
pub(crate) struct UserMemory {
    // Deregistered in Drop (or `into_memory`), before `owner` is dropped.
    reg: ManuallyDrop<Box<dyn Registration>>,
    ptr: NonNull<u8>,
    len: usize,
    /// The caller's value (`Box::into_raw` of a `Box<M>`), reached only
    /// through `ptr` while registered; rebuilt into a `Box` once, at drop
    /// or in `into_memory`.
    owner: NonNull<dyn Any + Send + Sync>,
    pool: Weak<PoolInner>,
}

// SAFETY: `owner` is a `Box<M>` with `M: Send + Sync` that only this value
// reaches (as a box, at drop), and its bytes are reached through `ptr` by
// `LocalRegion`'s copies and `load_u64`, which serialise through the
// region's lock; the registration is Send + Sync.
unsafe impl Send for UserMemory {}
// SAFETY: as above; `&UserMemory` gives out only the address and keys.
unsafe impl Sync for UserMemory {}

impl UserMemory {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn raw_mr(&self) -> usize {
        self.reg.raw_mr()
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.reg.lkey()
    }

    /// Whether `pool` may bind windows on this memory: the pool it was
    /// registered with, or a pool on the same device's shared PD.
    pub(crate) fn usable_with(&self, pool: &MemoryPool) -> bool {
        match self.pool.upgrade() {
            Some(mine) => {
                Arc::ptr_eq(&mine, &pool.inner)
                    || mine.device.as_ref().is_some_and(|d| pool.is_on_device(d))
            }
            None => false,
        }
    }

    /// Deregisters the memory and hands the caller's value back, or gives
    /// `self` back unchanged when it is not an `M`.
    pub(crate) fn into_memory<M: Any>(self) -> Result<M, UserMemory> {
        // SAFETY: `owner` is live (rebuilt only at drop, which has not
        // happened); `is` reads its type id only.
        if !unsafe { self.owner.as_ref() }.is::<M>() {
            return Err(self);
        }
        let mut me = ManuallyDrop::new(self);
        me.uncount();
        // SAFETY: dropped exactly once, here (`me` is never dropped), and
        // before the memory is handed back: the NIC can no longer reach it.
        unsafe { ManuallyDrop::drop(&mut me.reg) };
        // SAFETY: `owner` came from `Box::into_raw` and is rebuilt exactly
        // once, here; `me` is never dropped, so never twice. `me.pool`
        // (a `Weak`) is leaked with `me`: dropped explicitly next.
        let owner = unsafe { Box::from_raw(me.owner.as_ptr()) };
        // SAFETY: `me.pool` is read out once and `me` is never used again.
        drop(unsafe { std::ptr::read(&me.pool) });
        match owner.downcast::<M>() {
            Ok(m) => Ok(*m),
            Err(_) => unreachable!("the type was checked above"),
        }
    }

    fn uncount(&self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.regions.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for UserMemory {
    fn drop(&mut self) {
        self.uncount();
        // SAFETY: dropped exactly once, here, before the memory is freed
        // below.
        unsafe { ManuallyDrop::drop(&mut self.reg) };
        // SAFETY: `owner` came from `Box::into_raw` and is rebuilt exactly
        // once, here (`into_memory` never lets `Drop` run).
        drop(unsafe { Box::from_raw(self.owner.as_ptr()) });
    }
}

impl MemoryPool {
    /// Registers memory of the caller's (a `Vec<u8>`, `Box<[u8]>`,
    /// `BytesMut`, or a file or huge-page mapping such as `memmap2`'s
    /// `MmapMut`: any `AsMut<[u8]> + Send + Sync + 'static`) on the pool's
    /// protection domain, writable by the local NIC and with no remote
    /// access of its own, and makes all of `memory.as_mut()` a
    /// [`LocalRegion`](crate::remote::LocalRegion) that
    /// [`MessageEndpoint::grant`](crate::MessageEndpoint::grant) can open
    /// to a peer. The region owns `memory` (boxed: its bytes do not move)
    /// and keeps it registered while any clone, grant or revocation in
    /// progress holds it;
    /// [`LocalRegion::try_into_memory`](crate::remote::LocalRegion::try_into_memory)
    /// gives it back. A grant, `read_to` or `write_from` accepts it on
    /// endpoints whose `pool()` is this pool or, on a device with memory
    /// windows, another pool on the same device; on a device without them
    /// (Soft-iWARP) only on the endpoint whose `pool()` this is (its
    /// connection's own protection domain).
    ///
    /// Unlike [`register_vec`](Self::register_vec) (read-only, for sends),
    /// the NIC may write this memory (a peer's grant with WRITE or
    /// ATOMIC), so it must be writable: a read-only mapping fails to
    /// register. It does not count against
    /// [`PoolConfig::max_registered_bytes`](super::PoolConfig::max_registered_bytes)
    /// (the caller already has the memory); it counts in
    /// [`PoolStats::regions`](super::PoolStats::regions).
    ///
    /// # Errors
    /// [`PoolError::EmptyRegion`] when `memory` has no bytes;
    /// [`PoolError::Registration`] when the provider refuses (out of
    /// pinnable memory, `RLIMIT_MEMLOCK`, a read-only mapping), and in a
    /// child made by `fork()` (its source is
    /// [`Error::InheritedAfterFork`](crate::Error::InheritedAfterFork),
    /// `Unsupported`).
    pub fn register_local<M>(&self, memory: M) -> Result<crate::remote::LocalRegion, PoolError>
    where
        M: AsMut<[u8]> + Send + Sync + 'static,
    {
        let owner: Box<dyn Any + Send + Sync> = Box::new(memory);
        let owner = NonNull::from(Box::leak(owner));
        let rebuild = || {
            // SAFETY: `owner` came from `Box::leak` just above and is
            // rebuilt only on this failure path, once.
            drop(unsafe { Box::from_raw(owner.as_ptr()) })
        };
        // SAFETY: `owner` is the live, leaked box, reached only here; the
        // type is `M`, boxed above.
        let bytes: &mut [u8] = match unsafe { &mut *owner.as_ptr() }.downcast_mut::<M>() {
            Some(m) => m.as_mut(),
            None => unreachable!("boxed as M above"),
        };
        let (len, ptr) = (bytes.len(), bytes.as_mut_ptr());
        let Some(ptr) = NonNull::new(ptr).filter(|_| len > 0) else {
            rebuild();
            return Err(PoolError::EmptyRegion);
        };
        let pool = &self.inner;
        // SAFETY: `ptr..ptr+len` is the boxed value's bytes, valid for
        // reads and writes and not moved until the registration is
        // dropped: `UserMemory` drops the registration before it rebuilds
        // and drops the box, and nothing else reaches the box meanwhile.
        let reg = match unsafe { pool.registrar.register(ptr, len, Access::ReadWrite) } {
            Ok(reg) => reg,
            Err(e) => {
                rebuild();
                return Err(e);
            }
        };
        pool.regions.fetch_add(1, Ordering::Relaxed);
        Ok(crate::remote::LocalRegion::from_user(UserMemory {
            reg: ManuallyDrop::new(reg),
            ptr,
            len,
            owner,
            pool: Arc::downgrade(pool),
        }))
    }
}
