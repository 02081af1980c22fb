//! [`PoolBuf`] (an owned buffer of pool memory) and [`PoolBytes`] (a frozen,
//! cheaply cloned view of one that still knows its keys).

use std::fmt;
use std::io;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut, RangeBounds};
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::buf::UninitSlice;
use bytes::{BufMut, Bytes};

use super::{FreeEntry, PoolInner, RegisteredRegion, Slab};

/// An owned buffer of registered pool memory: capacity = its size class,
/// length = the bytes written so far (starts at 0).
///
/// Fill it through [`BufMut`] (`put_slice`, `put_u32`, ...), [`io::Write`],
/// or in place with [`spare_mut`](Self::spare_mut) + [`set_len`](Self::set_len);
/// read it through `Deref<Target = [u8]>` (the first `len()` bytes). Every
/// byte of the capacity is initialized (slabs are zeroed when registered,
/// and a reused buffer holds what it held before).
///
/// [`addr`](Self::addr), [`lkey`](Self::lkey) and [`rkey`](Self::rkey) name
/// it for work requests. Dropping it returns the memory to its pool; so does
/// dropping the last clone after [`freeze`](Self::freeze) or
/// [`into_bytes`](Self::into_bytes).
pub struct PoolBuf {
    // Taken in Drop to go back to the free list.
    slab: ManuallyDrop<Arc<Slab>>,
    pool: Arc<PoolInner>,
    ptr: NonNull<u8>,
    offset: usize,
    class: usize,
    cap: usize,
    len: usize,
}

// SAFETY: the buffer owns its byte range of the slab exclusively (no other
// PoolBuf covers it until this one is dropped); the slab and pool are
// Send + Sync.
unsafe impl Send for PoolBuf {}
// SAFETY: shared access only reads the range (`as_slice`); writes need
// `&mut self`.
unsafe impl Sync for PoolBuf {}

impl PoolBuf {
    pub(super) fn new(pool: Arc<PoolInner>, class: usize, cap: usize, entry: FreeEntry) -> Self {
        // SAFETY: `offset + cap` lies within the slab (the carving in
        // `new_slab`), so the pointer stays inside the same allocation.
        let ptr = unsafe { NonNull::new_unchecked(entry.slab.ptr.as_ptr().add(entry.offset)) };
        PoolBuf {
            slab: ManuallyDrop::new(entry.slab),
            pool,
            ptr,
            offset: entry.offset,
            class,
            cap,
            len: 0,
        }
    }

    /// Bytes written (0 ..= `capacity()`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Capacity in bytes: the buffer's size class.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The written bytes (`..len()`).
    pub fn as_slice(&self) -> &[u8] {
        &self.full()[..self.len]
    }

    /// The written bytes (`..len()`), mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.full_mut()[..len]
    }

    /// The bytes after the written part (`len()..capacity()`), to fill in
    /// place before [`set_len`](Self::set_len).
    pub fn spare_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.full_mut()[len..]
    }

    /// Sets the length (for example after the NIC or
    /// [`spare_mut`](Self::spare_mut) filled the buffer). The bytes are
    /// whatever the memory holds. Panics if `len > capacity()`.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.cap,
            "PoolBuf::set_len({len}) beyond capacity {}",
            self.cap
        );
        self.len = len;
    }

    /// Sets the length to 0.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// The virtual address of the first byte, as work requests name it.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The local key of the slab's memory region.
    pub fn lkey(&self) -> u32 {
        self.slab.reg.lkey()
    }

    /// The remote key of the slab's memory region. The slab is registered
    /// without remote access, so this key opens nothing to a peer (a
    /// rendezvous exposes a message through a memory window of its own).
    pub fn rkey(&self) -> u32 {
        self.slab.reg.rkey()
    }

    /// The slab's `ibv_mr` address, 0 for fakes (see
    /// [`Registration::raw_mr`](super::Registration::raw_mr)).
    pub(crate) fn raw_mr(&self) -> usize {
        self.slab.reg.raw_mr()
    }

    /// Freezes the written bytes into an immutable, cheaply cloned
    /// [`PoolBytes`] without copying. The memory returns to the pool when
    /// the last clone (and every `Bytes` made from one) drops.
    pub fn freeze(self) -> PoolBytes {
        let lkey = self.lkey();
        let rkey = self.rkey();
        let raw_mr = self.raw_mr();
        PoolBytes {
            bytes: Bytes::from_owner(self),
            lkey,
            rkey,
            raw_mr,
        }
    }

    /// Freezes the written bytes into [`Bytes`] without copying: its pointer
    /// is [`addr`](Self::addr). The memory returns to the pool when the last
    /// clone drops.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }

    fn full(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+cap` lies in the slab, which this buffer keeps
        // alive, is initialized (zeroed at allocation) and is accessed by no
        // other buffer; mutation needs `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }

    fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `full`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        // SAFETY: taken exactly once, here; the field is not used afterwards.
        let slab = unsafe { ManuallyDrop::take(&mut self.slab) };
        self.pool.give_back(
            self.class,
            FreeEntry {
                slab,
                offset: self.offset,
            },
        );
    }
}

impl Deref for PoolBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsMut<[u8]> for PoolBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl fmt::Debug for PoolBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBuf")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .field("lkey", &self.lkey())
            .finish()
    }
}

// SAFETY: `remaining_mut` is the spare capacity; `chunk_mut` returns exactly
// that (initialized) range; `advance_mut` only moves `len` within capacity.
unsafe impl BufMut for PoolBuf {
    fn remaining_mut(&self) -> usize {
        self.cap - self.len
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        assert!(
            cnt <= self.cap - self.len,
            "PoolBuf::advance_mut({cnt}) beyond capacity"
        );
        self.len += cnt;
    }

    fn chunk_mut(&mut self) -> &mut UninitSlice {
        UninitSlice::new(self.spare_mut())
    }
}

/// Writes up to the spare capacity; `Ok(0)` once full (for a non-empty
/// input), like `&mut [u8]`.
impl io::Write for PoolBuf {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(self.remaining_mut());
        self.put_slice(&data[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Frozen pool memory: [`Bytes`] plus the keys of the memory region it lies
/// in, so it can be posted without copying. Cheap to clone and slice; the
/// memory returns to the pool when the last clone (and every `Bytes` taken
/// from one) drops.
#[derive(Clone)]
pub struct PoolBytes {
    bytes: Bytes,
    lkey: u32,
    rkey: u32,
    /// The slab's `ibv_mr` (for memory-window binds), 0 for fakes.
    raw_mr: usize,
}

impl PoolBytes {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Virtual address of the first byte.
    pub fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    /// Local key of the memory region holding the bytes.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Remote key of the memory region holding the bytes (opens nothing to
    /// a peer: see [`PoolBuf::rkey`]).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The bytes as [`Bytes`] (borrowed).
    pub fn as_bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// The bytes as [`Bytes`], without copying.
    pub fn into_bytes(self) -> Bytes {
        self.bytes
    }

    /// A sub-range sharing the same memory (no copy), with the same keys.
    /// Panics if the range is out of bounds, like [`Bytes::slice`].
    pub fn slice(&self, range: impl RangeBounds<usize>) -> PoolBytes {
        PoolBytes {
            bytes: self.bytes.slice(range),
            lkey: self.lkey,
            rkey: self.rkey,
            raw_mr: self.raw_mr,
        }
    }
}

impl Deref for PoolBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl AsRef<[u8]> for PoolBytes {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl From<PoolBytes> for Bytes {
    fn from(b: PoolBytes) -> Bytes {
        b.bytes
    }
}

impl fmt::Debug for PoolBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBytes")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey)
            .finish()
    }
}

/// Registered memory ready to be sent as one message without copying: a
/// pool buffer (frozen or not) or a [`RegisteredRegion`] of user memory.
/// Built with `From`/`Into` from [`PoolBuf`], [`PoolBytes`] and
/// [`RegisteredRegion`]; the message endpoint keeps it until the NIC (or,
/// for a rendezvous, the peer's RDMA READ) is done with it.
#[derive(Debug, Clone)]
pub enum OutgoingMessage {
    /// Pool memory.
    Pool(PoolBytes),
    /// User memory registered for remote read.
    Region(RegisteredRegion),
}

impl OutgoingMessage {
    /// The message length, bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// True for an empty message.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Virtual address of the first byte.
    pub fn addr(&self) -> u64 {
        match self {
            OutgoingMessage::Pool(b) => b.addr(),
            OutgoingMessage::Region(r) => r.addr(),
        }
    }

    /// Local key of the memory region holding the message.
    pub fn lkey(&self) -> u32 {
        match self {
            OutgoingMessage::Pool(b) => b.lkey(),
            OutgoingMessage::Region(r) => r.lkey(),
        }
    }

    /// Remote key of the memory region holding the message. It opens
    /// nothing to a peer: a rendezvous binds a memory window over exactly
    /// the message, on the sending connection's QP, for as long as the
    /// peer reads it.
    pub fn rkey(&self) -> u32 {
        match self {
            OutgoingMessage::Pool(b) => b.rkey(),
            OutgoingMessage::Region(r) => r.rkey(),
        }
    }

    /// The `ibv_mr` address under the message, 0 for fakes.
    pub(crate) fn raw_mr(&self) -> usize {
        match self {
            OutgoingMessage::Pool(b) => b.raw_mr,
            OutgoingMessage::Region(r) => r.raw_mr(),
        }
    }

    /// Whether a rendezvous can expose it through a memory window (see
    /// [`RegisteredRegion::can_bind_windows`]).
    pub(crate) fn can_bind_windows(&self) -> bool {
        match self {
            OutgoingMessage::Pool(b) => b.raw_mr != 0,
            OutgoingMessage::Region(r) => r.can_bind_windows(),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            OutgoingMessage::Pool(b) => b,
            OutgoingMessage::Region(r) => r,
        }
    }
}

impl From<PoolBuf> for OutgoingMessage {
    fn from(b: PoolBuf) -> Self {
        OutgoingMessage::Pool(b.freeze())
    }
}

impl From<PoolBytes> for OutgoingMessage {
    fn from(b: PoolBytes) -> Self {
        OutgoingMessage::Pool(b)
    }
}

impl From<RegisteredRegion> for OutgoingMessage {
    fn from(r: RegisteredRegion) -> Self {
        OutgoingMessage::Region(r)
    }
}
