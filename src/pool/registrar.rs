//! Memory registration behind a crate-private trait: the verbs
//! implementation on a device's protection domain (PD), and
//! `FakeRegistrar` for the host tests. The traits are not public: a
//! registration hands the verbs layer the address of an `ibv_mr` to bind
//! memory windows on, which only the crate's own registrations can vouch
//! for.

#[cfg(test)]
use std::fmt;
#[cfg(test)]
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;
#[cfg(test)]
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::error::PoolError;
use crate::verbs::rc::{MemoryRegistration, MrAccess, OpenDevice};
use sideway::ibverbs::protection_domain::ProtectionDomain;

/// What the local NIC may do with registered memory. Neither grants a peer
/// anything: remote access goes through per-message memory windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Access {
    /// Local write (`IBV_ACCESS_LOCAL_WRITE`, plus `MW_BIND` where the
    /// device has memory windows): pool memory, which receives and RDMA
    /// READs land in.
    ReadWrite,
    /// No write at all (only `MW_BIND` where the device has memory
    /// windows): user memory registered for sending
    /// ([`RegisteredRegion`](super::RegisteredRegion)). The NIC never
    /// writes it, so read-only pages (a `&'static` in `.rodata`) can be
    /// registered.
    ReadOnly,
}

/// One live registration (a memory region, MR). Dropping it deregisters
/// the memory; the owner drops it before freeing that memory.
pub(crate) trait Registration: Send + Sync {
    /// The local key (lkey) that work requests on this PD use in their
    /// scatter/gather elements.
    fn lkey(&self) -> u32;
    /// The memory region's own remote key. Pool and user regions are
    /// registered without remote access, so this key opens nothing; peers
    /// reach a buffer only through a memory window bound for them.
    fn rkey(&self) -> u32;
    /// The address of the underlying `ibv_mr`, for binding memory windows
    /// on it; 0 for registrations without one (test fakes). Only the
    /// crate's verbs code dereferences it, and only the crate implements
    /// this trait.
    fn raw_mr(&self) -> usize {
        0
    }
    /// Whether memory windows can be bound on this registration (it has
    /// `MW_BIND`): false for read-only pages, which the kernel cannot pin
    /// for MW_BIND, and for test fakes.
    fn can_bind_windows(&self) -> bool {
        false
    }
}

/// Registers memory with a protection domain. The pool and
/// [`RegisteredRegion`](super::RegisteredRegion) call it; the real
/// implementation is built by [`MemoryPool::for_device`](super::MemoryPool::for_device),
/// `FakeRegistrar` serves host tests.
pub(crate) trait Registrar: Send + Sync + 'static {
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

/// The memory-region access flags for `access`: the least that works. No
/// registration of the pool is remotely accessible by its own key; where
/// the device has memory windows, `MW_BIND` lets a window open exactly one
/// message's bytes to exactly one connection, for as long as it is read.
pub(crate) fn mr_access(access: Access, memory_windows: bool) -> MrAccess {
    match (access, memory_windows) {
        (Access::ReadWrite, true) => MrAccess::LocalWriteMwBind,
        (Access::ReadWrite, false) => MrAccess::LocalWrite,
        (Access::ReadOnly, true) => MrAccess::MwBind,
        (Access::ReadOnly, false) => MrAccess::LocalRead,
    }
}

/// `ibv_reg_mr` on an opened device's protection domain (through the
/// verbs layer).
pub(crate) struct VerbsRegistrar {
    pub(crate) device: Arc<OpenDevice>,
    /// A PD of one connection's own (a message endpoint on a device
    /// without memory windows) instead of the device's shared one.
    /// Leaked in a forked child, like the QP's (`fork::ParentOnly`).
    pub(crate) pd: Option<crate::verbs::fork::ParentOnly<Arc<ProtectionDomain>>>,
}

impl Registration for MemoryRegistration {
    fn lkey(&self) -> u32 {
        MemoryRegistration::lkey(self)
    }
    fn rkey(&self) -> u32 {
        MemoryRegistration::rkey(self)
    }
    fn raw_mr(&self) -> usize {
        MemoryRegistration::raw_mr(self) as usize
    }
    fn can_bind_windows(&self) -> bool {
        MemoryRegistration::can_bind_windows(self)
    }
}

impl Registrar for VerbsRegistrar {
    unsafe fn register(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn Registration>, PoolError> {
        if let Some(pd) = &self.pd {
            // Local access only: no window can be bound on a PD of one
            // connection's own (such a device has none).
            let access = mr_access(access, false);
            // SAFETY: as below.
            let mr = unsafe { MemoryRegistration::on_pd(&self.device, pd, ptr, len, access) }
                .map_err(|source| PoolError::Registration { len, source })?;
            return Ok(Box::new(mr));
        }
        let access = mr_access(access, self.device.has_memory_windows());
        // SAFETY: the caller of `register` gives the same guarantee that
        // `MemoryRegistration::new` needs (memory valid until dropped).
        let mr = match unsafe { MemoryRegistration::new(&self.device, ptr, len, access) } {
            // Read-only pages (a `&'static` in .rodata) cannot be pinned for
            // MW_BIND (the kernel pins it writable): register them for local
            // reads only; such a region goes eagerly, or is copied for a
            // rendezvous.
            Err(e) if access == MrAccess::MwBind && e.raw_os_error() == Some(libc::EFAULT) => {
                // SAFETY: as above.
                unsafe { MemoryRegistration::new(&self.device, ptr, len, MrAccess::LocalRead) }
            }
            other => other,
        }
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
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct FakeRegistrar {
    state: Arc<FakeState>,
}

#[cfg(test)]
#[derive(Default)]
struct FakeState {
    registrations: AtomicU64,
    deregistrations: AtomicU64,
    bytes: AtomicU64,
    peak_bytes: AtomicU64,
    next_key: AtomicU32,
    fail: AtomicBool,
    last_access: std::sync::Mutex<Option<Access>>,
}

#[cfg(test)]
struct FakeRegistration {
    key: u32,
    len: u64,
    state: Arc<FakeState>,
}

#[cfg(test)]
impl Registration for FakeRegistration {
    fn lkey(&self) -> u32 {
        0x1000_0000 + self.key
    }
    fn rkey(&self) -> u32 {
        0x2000_0000 + self.key
    }
}

#[cfg(test)]
impl Drop for FakeRegistration {
    fn drop(&mut self) {
        self.state.bytes.fetch_sub(self.len, Ordering::SeqCst);
        self.state.deregistrations.fetch_add(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
impl FakeRegistrar {
    /// A registrar with all counters at zero.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Registrations made so far (successful ones).
    pub(crate) fn registrations(&self) -> u64 {
        self.state.registrations.load(Ordering::SeqCst)
    }

    /// Registrations dropped (deregistered) so far.
    pub(crate) fn deregistrations(&self) -> u64 {
        self.state.deregistrations.load(Ordering::SeqCst)
    }

    /// Bytes registered now (registered minus deregistered).
    pub(crate) fn registered_bytes(&self) -> u64 {
        self.state.bytes.load(Ordering::SeqCst)
    }

    /// The most bytes that were ever registered at the same time.
    pub(crate) fn peak_registered_bytes(&self) -> u64 {
        self.state.peak_bytes.load(Ordering::SeqCst)
    }

    /// The access of the latest successful registration.
    pub(crate) fn last_access(&self) -> Option<Access> {
        *self
            .state
            .last_access
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// While `fail` is true, every registration fails with
    /// [`PoolError::Registration`] (`ENOMEM`), as a provider out of
    /// pinnable memory would.
    pub(crate) fn set_fail(&self, fail: bool) {
        self.state.fail.store(fail, Ordering::SeqCst);
    }
}

#[cfg(test)]
impl fmt::Debug for FakeRegistrar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeRegistrar")
            .field("registrations", &self.registrations())
            .field("deregistrations", &self.deregistrations())
            .field("registered_bytes", &self.registered_bytes())
            .finish()
    }
}

#[cfg(test)]
impl Registrar for FakeRegistrar {
    unsafe fn register(
        &self,
        _ptr: NonNull<u8>,
        len: usize,
        access: Access,
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
        *self
            .state
            .last_access
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(access);
        let key = self.state.next_key.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Box::new(FakeRegistration {
            key,
            len,
            state: Arc::clone(&self.state),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No pool registration is remotely accessible by its own key: remote
    /// access exists only through memory windows.
    #[test]
    fn registrations_get_the_least_access_that_works() {
        assert_eq!(
            mr_access(Access::ReadWrite, true),
            MrAccess::LocalWriteMwBind
        );
        assert_eq!(mr_access(Access::ReadOnly, true), MrAccess::MwBind);
        assert_eq!(mr_access(Access::ReadWrite, false), MrAccess::LocalWrite);
        assert_eq!(mr_access(Access::ReadOnly, false), MrAccess::LocalRead);
        for access in [Access::ReadWrite, Access::ReadOnly] {
            for windows in [true, false] {
                assert!(
                    !mr_access(access, windows).grants_remote_access(),
                    "{access:?} windows={windows}"
                );
            }
        }
    }
}
