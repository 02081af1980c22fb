//! [`RegisteredRegion`]: memory the caller already has, registered for
//! zero-copy sends.

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
