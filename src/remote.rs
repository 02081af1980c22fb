//! Remote memory: grant a peer a window on your memory, and read, write
//! and atomically update what a peer granted you, with one-sided RDMA
//! operations that the peer's CPU takes no part in.
//!
//! - A [`LocalRegion`] is memory a peer may reach: a [`PoolBuf`] of the
//!   endpoint's pool, or memory of the caller's registered with
//!   [`MemoryPool::register_local`](crate::MemoryPool::register_local)
//!   (a `Vec`, a file or huge-page mapping), shared with the NIC from then on (read and written
//!   here only by copies, [`LocalRegion::read_at`]/[`LocalRegion::write_at`],
//!   since the peer's NIC may write it at any time).
//! - [`MessageEndpoint::grant`](crate::MessageEndpoint::grant) binds a
//!   type-2 memory window on that connection's queue pair (QP) over
//!   exactly a byte range of a region with exactly the access asked for
//!   ([`GrantAccess`]) and returns a [`Grant`]. Its [`RemoteRegion`]
//!   (address, length, key, access; [`RemoteRegion::encode`] gives its
//!   24-byte wire form) goes to the peer over any channel, typically a
//!   message on the same endpoint.
//! - The peer calls [`read`](crate::MessageEndpoint::read),
//!   [`write`](crate::MessageEndpoint::write),
//!   [`compare_swap`](crate::MessageEndpoint::compare_swap) and
//!   [`fetch_add`](crate::MessageEndpoint::fetch_add) on its endpoint
//!   with that `RemoteRegion`;
//!   [`write_notify`](crate::MessageEndpoint::write_notify) writes and
//!   tells the owner, which receives a [`Notification`] in order with the
//!   writer's messages
//!   ([`recv_incoming`](crate::MessageEndpoint::recv_incoming));
//!   [`transfer`](crate::MessageEndpoint::transfer) posts up to
//!   [`MAX_TRANSFER_BATCH`] READs and WRITEs ([`Transfer`]) with one
//!   doorbell and one signaled completion, a READ or WRITE of a batch
//!   possibly over a scatter-gather list of [`LocalSge`] entries
//!   ([`Transfer::ReadScatter`], [`Transfer::WriteGather`]);
//!   [`read_to`](crate::MessageEndpoint::read_to) and
//!   [`write_from`](crate::MessageEndpoint::write_from) (and
//!   [`Transfer::ReadTo`]/[`Transfer::WriteFrom`]) read into and write from
//!   a [`LocalRegion`] of its own in place, without a copy.
//!
//! # What a peer can and cannot do
//!
//! A peer reaches exactly the bytes of a grant it was handed, with exactly
//! the grant's access, through the one connection the grant was bound on
//! (a type-2 window is tied to its QP: the key is refused on any other
//! QP, IBTA vol. 1, 10.6.7.2.4), until the grant is revoked
//! ([`Grant::revoke`] returns once the NIC confirmed the invalidation;
//! dropping a `Grant` revokes it in the background) or the connection
//! ends. The memory regions under grants have no remote access of their
//! own. Nothing else of the process is reachable: not the rest of the
//! region, not other buffers of the pool. No clock crosses hosts: a grant
//! lasts until it is revoked, not for a lease.
//!
//! # Failures
//!
//! The requester checks every range against the `RemoteRegion` before
//! posting: out of range, misaligned atomics or an access the grant does
//! not give are `InvalidInput`, and nothing is posted. What the peer's NIC
//! refuses (a revoked key, another connection's key, a forged range) is
//! [`Error::RemoteAccess`](crate::Error::RemoteAccess)
//! (`PermissionDenied`), and, as on every reliable-connected QP (IBTA
//! vol. 1, 11.6.2), the QP goes to the error state: the endpoint fails
//! with that error, its messages and grants with it.
//!
//! # Cancellation
//!
//! Dropping an operation's future (or a timeout around it) never frees or
//! reuses memory the NIC may still read or write: the local buffer stays
//! with the endpoint's ledger of posted work until the operation's
//! completion or flush.

use std::fmt;
use std::future::Future;
use std::io;
use std::ops::{BitOr, Range};
use std::pin::Pin;
use std::sync::{Arc, RwLock, Weak};

use crate::pool::PoolBuf;
use crate::pool::region::UserMemory;

/// What a grant lets the peer do with its bytes: any set of RDMA READ,
/// RDMA WRITE and atomics (compare-and-swap, fetch-and-add). Combine with
/// `|`: `GrantAccess::READ | GrantAccess::ATOMIC`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct GrantAccess {
    pub(crate) read: bool,
    pub(crate) write: bool,
    pub(crate) atomic: bool,
}

impl GrantAccess {
    /// RDMA READ (`IBV_ACCESS_REMOTE_READ`).
    pub const READ: GrantAccess = GrantAccess {
        read: true,
        write: false,
        atomic: false,
    };
    /// RDMA WRITE (`IBV_ACCESS_REMOTE_WRITE`).
    pub const WRITE: GrantAccess = GrantAccess {
        read: false,
        write: true,
        atomic: false,
    };
    /// Atomics on aligned 8-byte words (`IBV_ACCESS_REMOTE_ATOMIC`).
    pub const ATOMIC: GrantAccess = GrantAccess {
        read: false,
        write: false,
        atomic: true,
    };

    /// Whether RDMA READ is allowed.
    pub fn read(self) -> bool {
        self.read
    }
    /// Whether RDMA WRITE is allowed.
    pub fn write(self) -> bool {
        self.write
    }
    /// Whether atomics are allowed.
    pub fn atomic(self) -> bool {
        self.atomic
    }
    /// Whether nothing is allowed.
    pub fn is_empty(self) -> bool {
        !(self.read || self.write || self.atomic)
    }
    /// Whether every access of `other` is in `self`.
    pub fn contains(self, other: GrantAccess) -> bool {
        (self.read || !other.read) && (self.write || !other.write) && (self.atomic || !other.atomic)
    }

    fn bits(self) -> u8 {
        u8::from(self.read) | u8::from(self.write) << 1 | u8::from(self.atomic) << 2
    }

    fn from_bits(bits: u8) -> Option<GrantAccess> {
        if bits & !0b111 != 0 {
            return None;
        }
        Some(GrantAccess {
            read: bits & 1 != 0,
            write: bits & 2 != 0,
            atomic: bits & 4 != 0,
        })
    }
}

impl BitOr for GrantAccess {
    type Output = GrantAccess;
    fn bitor(self, rhs: GrantAccess) -> GrantAccess {
        GrantAccess {
            read: self.read || rhs.read,
            write: self.write || rhs.write,
            atomic: self.atomic || rhs.atomic,
        }
    }
}

/// Memory a peer may reach through grants: one pool buffer's whole
/// capacity ([`LocalRegion::new`]), or memory of the caller's registered
/// for it ([`MemoryPool::register_local`](crate::pool::MemoryPool::register_local):
/// a `Vec<u8>`, `Box<[u8]>`, `BytesMut`, a file or huge-page mapping),
/// shared with the NIC from then on. Cheap to clone (an `Arc`); the memory
/// stays allocated and registered while any clone, any grant on it or any
/// revocation in progress lives.
///
/// A peer with a write or atomic grant may change its bytes at any time,
/// so the region hands out no `&[u8]`: [`read_at`](Self::read_at) and
/// [`write_at`](Self::write_at) copy (serialised among this process's
/// threads; the peer's NIC is not), and [`load_u64`](Self::load_u64)
/// reads a word the peer updates with atomics.
/// [`try_into_memory`](Self::try_into_memory) gives registered memory
/// back once nothing else holds the region.
#[derive(Clone)]
pub struct LocalRegion {
    inner: Arc<RegionInner>,
}

struct RegionInner {
    /// The memory; its bytes are reached only through `ptr` from here on.
    memory: Memory,
    /// Serialises this process's copies in and out.
    copies: RwLock<()>,
}

enum Memory {
    Pool(PoolBuf),
    User(UserMemory),
}

impl fmt::Debug for LocalRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalRegion")
            .field("addr", &self.addr())
            .field("len", &self.len())
            .finish()
    }
}

fn out_of_range(what: &str, offset: usize, len: usize, size: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what}: {len} bytes at offset {offset} exceed the region's {size} bytes"),
    )
}

impl LocalRegion {
    /// Makes `buf`'s whole capacity (bytes) a region; its contents are
    /// kept.
    pub fn new(buf: PoolBuf) -> LocalRegion {
        Self::with(Memory::Pool(buf))
    }

    pub(crate) fn from_user(memory: UserMemory) -> LocalRegion {
        Self::with(Memory::User(memory))
    }

    fn with(memory: Memory) -> LocalRegion {
        LocalRegion {
            inner: Arc::new(RegionInner {
                memory,
                copies: RwLock::new(()),
            }),
        }
    }

    /// Length in bytes: a pool buffer's capacity, or all of the
    /// registered memory.
    pub fn len(&self) -> usize {
        match &self.inner.memory {
            Memory::Pool(buf) => buf.capacity(),
            Memory::User(m) => m.len(),
        }
    }

    /// Whether the region has no bytes (never: empty memory is not
    /// registered).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The virtual address of its first byte.
    pub fn addr(&self) -> u64 {
        self.ptr() as u64
    }

    /// Gives back the memory registered by
    /// [`MemoryPool::register_local`](crate::pool::MemoryPool::register_local),
    /// deregistered, with whatever peers wrote into it.
    ///
    /// # Errors
    /// `self`, unchanged, while another clone, a grant (one dropped and
    /// being revoked in the background included) or an operation holds
    /// the region, when it is a pool buffer's, or when its memory is not
    /// an `M`.
    pub fn try_into_memory<M: std::any::Any>(self) -> Result<M, LocalRegion> {
        let inner = Arc::try_unwrap(self.inner).map_err(|inner| LocalRegion { inner })?;
        match inner.memory {
            Memory::User(m) => m.into_memory::<M>().map_err(LocalRegion::from_user),
            memory => Err(Self::with(memory)),
        }
    }

    /// Whether `pool`'s endpoints may grant this region: a buffer of
    /// `pool`, or memory registered with `pool` or another pool on the
    /// same device's shared protection domain.
    pub(crate) fn usable_with(&self, pool: &crate::pool::MemoryPool) -> bool {
        match &self.inner.memory {
            Memory::Pool(buf) => pool.owns(self.ptr(), buf.capacity()),
            Memory::User(m) => m.usable_with(pool),
        }
    }

    /// The local key of its registration (valid on the PD of the pool it
    /// is [`usable_with`](Self::usable_with)).
    pub(crate) fn lkey(&self) -> u32 {
        match &self.inner.memory {
            Memory::Pool(buf) => buf.lkey(),
            Memory::User(m) => m.lkey(),
        }
    }

    /// `InvalidInput` unless `len` bytes at `at` lie inside the region.
    pub(crate) fn check_range(&self, op: &str, at: usize, len: usize) -> io::Result<()> {
        if at.checked_add(len).is_none_or(|e| e > self.len()) {
            return Err(out_of_range(op, at, len, self.len()));
        }
        Ok(())
    }

    pub(crate) fn raw_mr(&self) -> usize {
        match &self.inner.memory {
            Memory::Pool(buf) => buf.raw_mr(),
            Memory::User(m) => m.raw_mr(),
        }
    }

    pub(crate) fn ptr(&self) -> *const u8 {
        match &self.inner.memory {
            Memory::Pool(buf) => buf.addr() as *const u8,
            Memory::User(m) => m.ptr(),
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the region.
    ///
    /// # Errors
    /// `InvalidInput` when the range passes the region's end.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> io::Result<()> {
        self.check_range("read_at", offset, dst.len())?;
        let _g = self.inner.copies.read().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the range lies inside the region (checked above), whose
        // memory lives as long as `self`; `dst` is a distinct allocation of the
        // caller's. Writers of this process hold the write lock; the NIC's
        // writes (a peer's grant) are outside the program, as with memory
        // shared with a device.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr().add(offset), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    ///
    /// # Errors
    /// `InvalidInput` when the range passes the region's end.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> io::Result<()> {
        self.check_range("write_at", offset, src.len())?;
        let _g = self.inner.copies.write().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the range lies inside the region (checked above), whose
        // memory lives as long as `self` and is registered for the NIC only
        // (no Rust reference to its bytes exists); the write lock excludes
        // this process's other copies; `src` is the caller's.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.ptr().add(offset) as *mut u8,
                src.len(),
            );
        }
        Ok(())
    }

    /// Reads the 8-byte word at `offset` atomically, in host byte order:
    /// the value a peer's compare-and-swap or fetch-and-add left there.
    ///
    /// # Errors
    /// `InvalidInput` when the word passes the region's end or its address
    /// ([`addr`](Self::addr) + `offset`) is not a multiple of 8 (pool
    /// buffers are aligned to their class size or 4 KiB, whichever is
    /// smaller; registered memory is as aligned as its allocation).
    pub fn load_u64(&self, offset: usize) -> io::Result<u64> {
        let len = self.len();
        let aligned = (self.addr() as usize).wrapping_add(offset) % 8 == 0;
        if !aligned || offset.checked_add(8).is_none_or(|e| e > len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "load_u64 at offset {offset} of a {len}-byte region at {:#x} (8-byte aligned words only)",
                    self.addr()
                ),
            ));
        }
        let _g = self.inner.copies.read().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the word lies inside the region and its address is
        // 8-byte aligned (both checked above); the region's memory lives as
        // long as `self`. This process's only non-atomic writer,
        // `write_at`, holds the write lock, which the read lock above
        // excludes; the NIC's writes and atomics are outside the program.
        let word = unsafe { &*(self.ptr().add(offset) as *const std::sync::atomic::AtomicU64) };
        Ok(word.load(std::sync::atomic::Ordering::Acquire))
    }
}

/// Most operations one [`MessageEndpoint::transfer`](crate::MessageEndpoint::transfer)
/// batch posts: the send-queue slots a connection keeps for remote
/// memory, 32 (perftest's `--post_list` figure for doorbell batching in
/// the reference, `ib_write_bw --post_list 32`; each slot is one
/// send WQE more per connection).
pub const MAX_TRANSFER_BATCH: usize = 32;

/// One operation of a batch posted with one doorbell
/// ([`MessageEndpoint::transfer`](crate::MessageEndpoint::transfer)).
#[derive(Debug, Clone, Copy)]
pub enum Transfer<'a> {
    /// RDMA READ of `len` bytes (at most 2 GiB) at `offset` of `remote`
    /// (a grant with READ access).
    Read {
        /// The peer's grant.
        remote: &'a RemoteRegion,
        /// Offset in the grant, bytes.
        offset: u64,
        /// Bytes to read.
        len: usize,
    },
    /// RDMA WRITE of `data` (at most 2 GiB) at `offset` of `remote` (a
    /// grant with WRITE access).
    Write {
        /// The peer's grant.
        remote: &'a RemoteRegion,
        /// Offset in the grant, bytes.
        offset: u64,
        /// The bytes to write (copied into pool memory first).
        data: &'a [u8],
    },
    /// RDMA READ of `len` bytes at `offset` of `remote` (READ access)
    /// straight into `len` bytes at `at` of `dst`, zero-copy (see
    /// [`MessageEndpoint::read_to`](crate::MessageEndpoint::read_to)).
    ReadTo {
        /// The peer's grant.
        remote: &'a RemoteRegion,
        /// Offset in the grant, bytes.
        offset: u64,
        /// The local region the bytes land in.
        dst: &'a LocalRegion,
        /// Offset in `dst`, bytes.
        at: usize,
        /// Bytes to read.
        len: usize,
    },
    /// RDMA WRITE of `len` bytes at `at` of `src`, zero-copy, at `offset`
    /// of `remote` (WRITE access) (see
    /// [`MessageEndpoint::write_from`](crate::MessageEndpoint::write_from)).
    WriteFrom {
        /// The peer's grant.
        remote: &'a RemoteRegion,
        /// Offset in the grant, bytes.
        offset: u64,
        /// The local region the bytes come from.
        src: &'a LocalRegion,
        /// Offset in `src`, bytes.
        at: usize,
        /// Bytes to write.
        len: usize,
    },
    /// One RDMA READ of the list's total length at `offset` of `remote`
    /// (READ access), scattered in place over `dst` in order: the first
    /// entry's bytes first. One WR with one SGE per entry, zero-copy. At
    /// most [`MessageEndpoint::max_read_sge`](crate::MessageEndpoint::max_read_sge)
    /// entries (the QP's send SGEs and the device's `max_sge_rd`), each
    /// at least 1 byte, 2 GiB in all.
    ReadScatter {
        /// The peer's grant.
        remote: &'a RemoteRegion,
        /// Offset in the grant, bytes.
        offset: u64,
        /// Where the bytes land, in order.
        dst: &'a [LocalSge<'a>],
    },
    /// One RDMA WRITE at `offset` of `remote` (WRITE access) of the bytes
    /// of `src` gathered in order, zero-copy: one WR with one SGE per
    /// entry. At most
    /// [`MessageEndpoint::max_sge`](crate::MessageEndpoint::max_sge)
    /// entries, each at least 1 byte, 2 GiB in all.
    WriteGather {
        /// The peer's grant.
        remote: &'a RemoteRegion,
        /// Offset in the grant, bytes.
        offset: u64,
        /// The bytes to write, in order.
        src: &'a [LocalSge<'a>],
    },
}

/// One entry of a scatter-gather list ([`Transfer::ReadScatter`],
/// [`Transfer::WriteGather`]): `len` bytes at `at` of a [`LocalRegion`],
/// which the WR names by address, length and the region's lkey (an SGE,
/// `struct ibv_sge`). Entries of one list may lie in different regions.
#[derive(Debug, Clone, Copy)]
pub struct LocalSge<'a> {
    /// The region: a buffer of the endpoint's pool, or memory registered
    /// on its protection domain (as for
    /// [`MessageEndpoint::read_to`](crate::MessageEndpoint::read_to)).
    pub region: &'a LocalRegion,
    /// Offset in the region, bytes.
    pub at: usize,
    /// Bytes, at least 1.
    pub len: usize,
}

impl<'a> LocalSge<'a> {
    /// `len` bytes at `at` of `region`.
    pub fn new(region: &'a LocalRegion, at: usize, len: usize) -> Self {
        LocalSge { region, at, len }
    }
}

/// What [`MessageEndpoint::write_notify`](crate::MessageEndpoint::write_notify)
/// tells the owner of the memory it wrote: the writer's `value` and how
/// many bytes it wrote, handed out by
/// [`MessageEndpoint::recv_incoming`](crate::MessageEndpoint::recv_incoming)
/// in order with the writer's messages. The bytes are in place when it
/// arrives (RC ordering: IBTA vol. 1, 9.5; RFC 5040, 5.5 on iWARP); where
/// they went is for the two applications to agree on (the value can name
/// a slot, for example). On InfiniBand and RoCE `len` is what the NIC
/// wrote; on iWARP the peer states it in the SEND that follows its WRITE.
/// A peer is not trusted: treat `value`, and on iWARP `len`, as its claim,
/// like a message's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Notification {
    /// The writer's value, `0..2^29`.
    pub value: u32,
    /// Bytes written, `0..=2^31`.
    pub len: u32,
}

/// The peer's side of a grant: `len` bytes at virtual address `addr` of
/// the granting process, reached with remote key `rkey` through the one
/// connection the grant was bound on, with `access`.
///
/// Its wire form ([`encode`](Self::encode), [`decode`](Self::decode)) is
/// 24 bytes, little-endian: version (1 byte, 1), access bits (1 byte: 1
/// READ, 2 WRITE, 4 ATOMIC), 2 bytes zero, rkey (4), addr (8), len (8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    addr: u64,
    len: u64,
    rkey: u32,
    access: GrantAccess,
}

/// With feature `serde`: a [`RemoteRegion`] serializes as its 24-byte wire
/// form ([`RemoteRegion::encode`]; bytes, or a sequence of 24 numbers in
/// formats without bytes such as JSON) and deserializes through
/// [`RemoteRegion::decode`], so a peer's malformed region is an error of
/// the format, never a region.
#[cfg(feature = "serde")]
impl serde::Serialize for RemoteRegion {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.encode())
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for RemoteRegion {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Wire;
        impl<'de> serde::de::Visitor<'de> for Wire {
            type Value = RemoteRegion;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "the {REMOTE_REGION_LEN}-byte wire form of a remote region"
                )
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<RemoteRegion, E> {
                RemoteRegion::decode(v).map_err(E::custom)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<RemoteRegion, A::Error> {
                let mut bytes = Vec::with_capacity(REMOTE_REGION_LEN);
                while let Some(b) = seq.next_element::<u8>()? {
                    if bytes.len() > REMOTE_REGION_LEN {
                        break;
                    }
                    bytes.push(b);
                }
                RemoteRegion::decode(&bytes).map_err(serde::de::Error::custom)
            }
        }
        deserializer.deserialize_bytes(Wire)
    }
}

/// Bytes of [`RemoteRegion::encode`]'s wire form.
pub const REMOTE_REGION_LEN: usize = 24;

/// Why bytes are not a [`RemoteRegion`] ([`RemoteRegion::decode`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteRegionError {
    /// Not [`REMOTE_REGION_LEN`] bytes.
    #[error("a remote region is {REMOTE_REGION_LEN} bytes, got {0}")]
    Length(usize),
    /// A version other than 1.
    #[error("unknown remote region version {0}")]
    Version(u8),
    /// Unknown access bits or non-zero reserved bytes.
    #[error("malformed remote region (access bits {0:#x})")]
    Malformed(u8),
    /// `addr + len` overflows.
    #[error("remote region range overflows")]
    Overflow,
}

impl RemoteRegion {
    /// The granted bytes' virtual address at the peer.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the grant covers no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// What the grant allows.
    pub fn access(&self) -> GrantAccess {
        self.access
    }

    /// The 24-byte wire form (see the type's docs).
    pub fn encode(&self) -> [u8; REMOTE_REGION_LEN] {
        let mut b = [0u8; REMOTE_REGION_LEN];
        b[0] = 1;
        b[1] = self.access.bits();
        b[4..8].copy_from_slice(&self.rkey.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses the wire form. A peer may send anything: whatever it claims
    /// is only what the requester will ask its NIC for; the granting NIC
    /// refuses what the grant does not cover.
    ///
    /// # Errors
    /// [`RemoteRegionError`] for a wrong length, version, access bits or
    /// an overflowing range.
    pub fn decode(bytes: &[u8]) -> Result<RemoteRegion, RemoteRegionError> {
        if bytes.len() != REMOTE_REGION_LEN {
            return Err(RemoteRegionError::Length(bytes.len()));
        }
        if bytes[0] != 1 {
            return Err(RemoteRegionError::Version(bytes[0]));
        }
        let access = GrantAccess::from_bits(bytes[1])
            .filter(|_| bytes[2] == 0 && bytes[3] == 0)
            .ok_or(RemoteRegionError::Malformed(bytes[1]))?;
        let word = |r: Range<usize>| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&bytes[r]);
            u64::from_le_bytes(a)
        };
        let rkey = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        let (addr, len) = (word(8..16), word(16..24));
        if addr.checked_add(len).is_none() {
            return Err(RemoteRegionError::Overflow);
        }
        Ok(RemoteRegion {
            addr,
            len,
            rkey,
            access,
        })
    }

    pub(crate) fn new(addr: u64, len: u64, rkey: u32, access: GrantAccess) -> RemoteRegion {
        RemoteRegion {
            addr,
            len,
            rkey,
            access,
        }
    }

    /// The remote address of `len` bytes at `offset` for `want`, checked
    /// against the grant before anything is posted.
    pub(crate) fn check(
        &self,
        op: &'static str,
        offset: u64,
        len: u64,
        want: GrantAccess,
    ) -> io::Result<u64> {
        if !self.access.contains(want) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{op}: the grant does not allow it (it allows {:?})",
                    self.access
                ),
            ));
        }
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{op}: {len} bytes at offset {offset} exceed the grant's {} bytes",
                    self.len
                ),
            ));
        }
        let addr = self.addr + offset;
        if want.atomic && addr % 8 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{op}: atomics need an 8-byte aligned address (offset {offset})"),
            ));
        }
        Ok(addr)
    }
}

/// A window on a [`LocalRegion`] granted to one connection's peer, from
/// [`MessageEndpoint::grant`](crate::MessageEndpoint::grant). Hand
/// [`remote`](Self::remote) to the peer. Revoked by
/// [`revoke`](Self::revoke), or in the background when dropped; ends with
/// its connection in any case.
pub struct Grant {
    pub(crate) conn: Weak<dyn GrantOwner>,
    pub(crate) id: u64,
    pub(crate) remote: RemoteRegion,
    pub(crate) revoked: bool,
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant")
            .field("remote", &self.remote)
            .finish()
    }
}

impl Grant {
    /// What the peer needs to use the grant.
    pub fn remote(&self) -> RemoteRegion {
        self.remote
    }

    /// Invalidates the window and returns once the NIC confirmed (the
    /// LOCAL_INV completed): from then on the key opens nothing, and an
    /// operation of the peer that was still in flight either completed
    /// before or fails with a remote access error. A grant whose
    /// connection already ended is revoked with it: `Ok`.
    ///
    /// # Errors
    /// `ConnectionReset` (or the connection's own error) when the
    /// connection fails before the NIC confirmed; the key is dead then
    /// too (its QP is in the error state).
    pub async fn revoke(mut self) -> io::Result<()> {
        crate::verbs::fork::check_io("Grant::revoke")?;
        self.revoked = true;
        let Some(conn) = self.conn.upgrade() else {
            return Ok(());
        };
        conn.revoke(self.id).await
    }
}

/// What a [`Grant`] needs of the connection that bound it: revoking its
/// window. The message endpoint's connection implements it, so this
/// module does not depend on the endpoint.
pub(crate) trait GrantOwner: Send + Sync {
    /// Invalidates grant `id`'s window; resolves once the NIC confirmed
    /// the LOCAL_INV, or at once with `Ok` when the connection already
    /// ended. Errors as [`Grant::revoke`].
    fn revoke(self: Arc<Self>, id: u64) -> Pin<Box<dyn Future<Output = io::Result<()>> + Send>>;

    /// Invalidates grant `id`'s window in the background (the grant was
    /// dropped); nothing when the connection already ended.
    fn revoke_dropped(&self, id: u64);
}

impl Drop for Grant {
    fn drop(&mut self) {
        // In a forked child the window is the parent's: left alone.
        if self.revoked || crate::verbs::fork::inherited() {
            return;
        }
        if let Some(conn) = self.conn.upgrade() {
            conn.revoke_dropped(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remote_region_round_trips_through_its_wire_form() {
        let r = RemoteRegion::new(
            0x7f00_dead_b000,
            4096,
            0x1234_5678,
            GrantAccess::READ | GrantAccess::ATOMIC,
        );
        let b = r.encode();
        assert_eq!(b.len(), 24);
        assert_eq!(b[0], 1);
        assert_eq!(b[1], 0b101);
        assert_eq!(&b[4..8], &0x1234_5678u32.to_le_bytes());
        assert_eq!(RemoteRegion::decode(&b), Ok(r));
    }

    #[test]
    fn bad_wire_forms_are_typed_errors() {
        let good = RemoteRegion::new(8, 8, 1, GrantAccess::WRITE).encode();
        assert_eq!(
            RemoteRegion::decode(&good[..23]),
            Err(RemoteRegionError::Length(23))
        );
        let mut b = good;
        b[0] = 2;
        assert_eq!(RemoteRegion::decode(&b), Err(RemoteRegionError::Version(2)));
        let mut b = good;
        b[1] = 8;
        assert_eq!(
            RemoteRegion::decode(&b),
            Err(RemoteRegionError::Malformed(8))
        );
        let mut b = good;
        b[3] = 1;
        assert_eq!(
            RemoteRegion::decode(&b),
            Err(RemoteRegionError::Malformed(2))
        );
        let over = RemoteRegion::new(u64::MAX - 3, 8, 1, GrantAccess::READ).encode();
        assert_eq!(
            RemoteRegion::decode(&over),
            Err(RemoteRegionError::Overflow)
        );
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_carries_the_wire_form_and_checks_it_on_the_way_in() {
        let r = RemoteRegion::new(0x7f00_0000_1000, 96, 0xA1B2_C3D4, GrantAccess::WRITE);
        let json = serde_json::to_string(&r).unwrap();
        // JSON has no bytes: the 24 bytes as numbers.
        assert_eq!(
            json,
            "[1,2,0,0,212,195,178,161,0,16,0,0,0,127,0,0,96,0,0,0,0,0,0,0]"
        );
        assert_eq!(serde_json::from_str::<RemoteRegion>(&json).unwrap(), r);
        // A peer's bad region: an error of the format, never a region.
        let version_2 = json.replacen("[1,", "[2,", 1);
        let e = serde_json::from_str::<RemoteRegion>(&version_2).unwrap_err();
        assert!(
            e.to_string().contains("unknown remote region version 2"),
            "{e}"
        );
        let short = "[1,2,0,0]";
        let e = serde_json::from_str::<RemoteRegion>(short).unwrap_err();
        assert!(e.to_string().contains("is 24 bytes, got 4"), "{e}");
        let long = json.replacen(']', ",0,0]", 1);
        assert!(serde_json::from_str::<RemoteRegion>(&long).is_err());
    }

    #[test]
    fn ranges_and_access_are_checked_before_posting() {
        let r = RemoteRegion::new(4096, 64, 7, GrantAccess::READ | GrantAccess::ATOMIC);
        assert_eq!(r.check("READ", 0, 64, GrantAccess::READ).unwrap(), 4096);
        assert_eq!(r.check("READ", 63, 1, GrantAccess::READ).unwrap(), 4159);
        let e = r.check("READ", 60, 8, GrantAccess::READ).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let e = r.check("READ", u64::MAX, 2, GrantAccess::READ).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let e = r.check("WRITE", 0, 8, GrantAccess::WRITE).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(r.check("ATOMIC", 8, 8, GrantAccess::ATOMIC).unwrap(), 4104);
        let e = r.check("ATOMIC", 4, 8, GrantAccess::ATOMIC).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(GrantAccess::READ.contains(GrantAccess::default()));
        assert!(!GrantAccess::READ.contains(GrantAccess::WRITE));
        assert!(GrantAccess::default().is_empty());
    }
}
