//! Memory registration behind a trait: the verbs implementation on a
//! device's protection domain (PD), and [`FakeRegistrar`] for host tests.

use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::error::PoolError;
use crate::verbs::rc::{MemoryRegistration, MrAccess, OpenDevice};

/// What the NIC may do with registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Access {
    /// Local write, remote write and remote read
    /// (`IBV_ACCESS_LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ`): pool memory,
    /// which receives land in and peers may RDMA READ or WRITE.
    ReadWrite,
    /// Remote read only (`IBV_ACCESS_REMOTE_READ`): user memory registered
    /// for sending ([`RegisteredRegion`](super::RegisteredRegion)). The NIC
    /// never writes it, so read-only pages (a `&'static` in `.rodata`) can be
    /// registered.
    ReadOnly,
}

/// One live registration (a memory region, MR). Dropping it deregisters
/// the memory; the owner drops it before freeing that memory.
pub trait Registration: Send + Sync {
    /// The local key (lkey) that work requests on this PD use in their
    /// scatter/gather elements.
    fn lkey(&self) -> u32;
    /// The remote key (rkey) a peer uses for RDMA READ/WRITE into this memory.
    fn rkey(&self) -> u32;
}

/// Registers memory with a protection domain. The pool and
/// [`RegisteredRegion`](super::RegisteredRegion) call it; the real
/// implementation is built by [`MemoryPool::for_device`](super::MemoryPool::for_device),
/// [`FakeRegistrar`] serves host tests.
pub trait Registrar: Send + Sync + 'static {
    /// Registers `len` (> 0) bytes at `ptr` with `access`, returning the
    /// registration that deregisters when dropped. Errors with
    /// [`PoolError::Registration`] when the provider refuses.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads of `len` bytes (and for writes, by the
    /// NIC, when `access` is [`Access::ReadWrite`]) until the returned
    /// registration is dropped, and the caller must drop the registration
    /// before it frees or reuses that memory.
    unsafe fn register(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn Registration>, PoolError>;
}

/// `ibv_reg_mr` on an opened device's protection domain (through the
/// verbs layer).
pub(crate) struct VerbsRegistrar {
    pub(crate) device: Arc<OpenDevice>,
}

impl Registration for MemoryRegistration {
    fn lkey(&self) -> u32 {
        MemoryRegistration::lkey(self)
    }
    fn rkey(&self) -> u32 {
        MemoryRegistration::rkey(self)
    }
}

impl Registrar for VerbsRegistrar {
    unsafe fn register(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn Registration>, PoolError> {
        let access = match access {
            Access::ReadWrite => MrAccess::LocalRemoteReadWrite,
            Access::ReadOnly => MrAccess::RemoteRead,
        };
        // SAFETY: the caller of `register` gives the same guarantee that
        // `MemoryRegistration::new` needs (memory valid until dropped).
        let mr = unsafe { MemoryRegistration::new(&self.device, ptr, len, access) }
            .map_err(|source| PoolError::Registration { len, source })?;
        Ok(Box::new(mr))
    }
}

/// A [`Registrar`] for host tests: registers nothing, hands out distinct
/// non-zero fake keys and counts registrations. Cheap to clone; clones share
/// their counters, so a test keeps one clone and gives the other to
/// [`MemoryPool::with_registrar`](super::MemoryPool::with_registrar).
///
/// The n-th registration (from 1) gets lkey `0x1000_0000 + n` and rkey
/// `0x2000_0000 + n`.
#[derive(Clone, Default)]
pub struct FakeRegistrar {
    state: Arc<FakeState>,
}

#[derive(Default)]
struct FakeState {
    registrations: AtomicU64,
    deregistrations: AtomicU64,
    bytes: AtomicU64,
    peak_bytes: AtomicU64,
    next_key: AtomicU32,
    fail: AtomicBool,
}

struct FakeRegistration {
    key: u32,
    len: u64,
    state: Arc<FakeState>,
}

impl Registration for FakeRegistration {
    fn lkey(&self) -> u32 {
        0x1000_0000 + self.key
    }
    fn rkey(&self) -> u32 {
        0x2000_0000 + self.key
    }
}

impl Drop for FakeRegistration {
    fn drop(&mut self) {
        self.state.bytes.fetch_sub(self.len, Ordering::SeqCst);
        self.state.deregistrations.fetch_add(1, Ordering::SeqCst);
    }
}

impl FakeRegistrar {
    /// A registrar with all counters at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registrations made so far (successful ones).
    pub fn registrations(&self) -> u64 {
        self.state.registrations.load(Ordering::SeqCst)
    }

    /// Registrations dropped (deregistered) so far.
    pub fn deregistrations(&self) -> u64 {
        self.state.deregistrations.load(Ordering::SeqCst)
    }

    /// Bytes registered now (registered minus deregistered).
    pub fn registered_bytes(&self) -> u64 {
        self.state.bytes.load(Ordering::SeqCst)
    }

    /// The most bytes that were ever registered at the same time.
    pub fn peak_registered_bytes(&self) -> u64 {
        self.state.peak_bytes.load(Ordering::SeqCst)
    }

    /// While `fail` is true, every registration fails with
    /// [`PoolError::Registration`] (`ENOMEM`), as a provider out of
    /// pinnable memory would.
    pub fn set_fail(&self, fail: bool) {
        self.state.fail.store(fail, Ordering::SeqCst);
    }
}

impl fmt::Debug for FakeRegistrar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeRegistrar")
            .field("registrations", &self.registrations())
            .field("deregistrations", &self.deregistrations())
            .field("registered_bytes", &self.registered_bytes())
            .finish()
    }
}

impl Registrar for FakeRegistrar {
    unsafe fn register(
        &self,
        _ptr: NonNull<u8>,
        len: usize,
        _access: Access,
    ) -> Result<Box<dyn Registration>, PoolError> {
        if self.state.fail.load(Ordering::SeqCst) {
            return Err(PoolError::Registration {
                len,
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            });
        }
        let len = len as u64;
        let now = self.state.bytes.fetch_add(len, Ordering::SeqCst) + len;
        self.state.peak_bytes.fetch_max(now, Ordering::SeqCst);
        self.state.registrations.fetch_add(1, Ordering::SeqCst);
        let key = self.state.next_key.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Box::new(FakeRegistration {
            key,
            len,
            state: Arc::clone(&self.state),
        }))
    }
}
