//! The queue pair of a message endpoint, owning every buffer the NIC may
//! touch: receive buffers while posted, rendezvous destinations while an
//! RDMA READ into them is outstanding, and the messages being sent.
//!
//! Buffers are named by the runtime's tokens (those of
//! `MessageCore`). The runtime can only
//! take a buffer back once the NIC is done with it: a receive buffer after
//! its completion, a destination once no READ into it is outstanding. What
//! the runtime gives up while a posted WR still names it (a message the
//! core reclaimed at an abort while its SEND is posted, a destination whose
//! READ is in flight) goes to the send queue's [`Ledger`], which frees it at
//! that WR's completion or flush. So the `unsafe` of posting work requests
//! (WRs) with scatter/gather elements (SGEs) stays here, in the one module
//! of the message runtime that opts into `unsafe` (a scoped `allow`, each
//! block with its `SAFETY:` comment). Field order makes the QP be destroyed
//! before any buffer is freed.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::pool::{OutgoingMessage, PoolBuf};
use crate::proto::message::{MsgTransmit, MsgTransmitKind, RTS_HEADER_LEN, RtsHeader};
use crate::verbs::ledger::{Ledger, PostedOp};
use crate::verbs::mw::{MemoryWindow, WindowAccess};
use crate::verbs::rc::{
    BindTarget, MW_WR_FLAG, RECV_WR_FLAG, RcQueuePair, SendOp, SendPayload, SendWr, Sge,
};

/// Bytes of scratch per send-queue slot for an RTS header that is not
/// posted inline.
const RTS_SLOT: usize = 32;

/// The SGE of the last data WR posted (a SEND with payload or a READ), for
/// the zero-copy checks of the guest test suite (recorded only in its
/// builds).
#[cfg(tokio_rdma_guest)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostedSge {
    /// Virtual address the NIC reads (SEND) or writes (READ).
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// Local key.
    pub lkey: u32,
}

pub(crate) struct MessageQp {
    // Dropped first: windows are deallocated before the QP they are bound
    // to and before the memory regions under them; then the QP is
    // destroyed before the buffers below.
    windows: Windows,
    qp: RcQueuePair,
    /// Posted send-queue WRs not known complete, and what the runtime gave
    /// up while one of them still names it (after the QP: freed once it is
    /// destroyed).
    ledger: Ledger<u64, Held>,
    send_depth: u64,
    /// Posted receive buffers by token.
    recv: HashMap<u64, PoolBuf>,
    /// Rendezvous destinations by token.
    dests: HashMap<u64, PoolBuf>,
    /// Messages being sent, by token.
    sending: HashMap<u64, OutgoingMessage>,
    #[cfg(tokio_rdma_guest)]
    last_sge: Option<PostedSge>,
}

/// Memory of this QP's that a posted send-queue WR may still name when the
/// runtime gives it up: kept by the [`Ledger`] until that WR is done.
enum Held {
    /// A message an eager SEND reads.
    Message(#[allow(dead_code)] OutgoingMessage),
    /// A rendezvous destination an RDMA READ writes.
    Dest(#[allow(dead_code)] PoolBuf),
}

fn internal(msg: String) -> Error {
    Error::Internal(msg)
}

/// The memory windows of one QP: a rendezvous source is exposed to the peer
/// through a type-2 window bound on this QP over exactly the message's
/// bytes, read-only, from its RTS until the peer's DONE (or an abort), and
/// invalidated (LOCAL_INV completed) before the message's memory is
/// released. A window is then reused with a new key.
#[derive(Default)]
struct Windows {
    /// Unbound windows, ready for the next rendezvous.
    free: Vec<MemoryWindow>,
    /// Bound windows by message token.
    bound: HashMap<u64, MemoryWindow>,
    /// Windows being invalidated, by the LOCAL_INV's wr_id, with their
    /// message's token.
    invalidating: HashMap<u64, (u64, MemoryWindow)>,
    /// Tokens whose message is done and whose window awaits its LOCAL_INV.
    to_invalidate: Vec<u64>,
    /// Next wr_id (with [`MW_WR_FLAG`]) for a bind or an invalidation.
    next_wr: u64,
    /// Binds posted over the QP's life.
    binds: u64,
    /// The last window bound: (address, length, key).
    last: Option<(u64, u64, u32)>,
}

impl Windows {
    fn wr_id(&mut self) -> u64 {
        self.next_wr += 1;
        MW_WR_FLAG | self.next_wr
    }
}

impl AsMut<RcQueuePair> for MessageQp {
    fn as_mut(&mut self) -> &mut RcQueuePair {
        &mut self.qp
    }
}

impl MessageQp {
    /// Wraps `qp`, whose send buffer must hold `send_depth * 32` bytes of RTS
    /// scratch.
    pub(crate) fn new(qp: RcQueuePair, send_depth: u16) -> Self {
        MessageQp {
            windows: Windows::default(),
            qp,
            ledger: Ledger::default(),
            send_depth: u64::from(send_depth.max(1)),
            recv: HashMap::new(),
            dests: HashMap::new(),
            sending: HashMap::new(),
            #[cfg(tokio_rdma_guest)]
            last_sge: None,
        }
    }

    /// Scratch bytes a QP for `send_depth` needs (`RcSizes::send_buf`).
    pub(crate) fn scratch_len(send_depth: u16) -> usize {
        usize::from(send_depth.max(1)) * RTS_SLOT
    }

    pub(crate) fn qp_ref(&self) -> &RcQueuePair {
        &self.qp
    }

    /// Posts receive buffers (their whole capacity), keeping them until
    /// [`take_recv`](Self::take_recv). The receive WR id is the token with
    /// [`RECV_WR_FLAG`] set.
    pub(crate) fn post_recvs(&mut self, bufs: Vec<(u64, PoolBuf)>) -> Result<()> {
        let mut wrs = Vec::with_capacity(bufs.len());
        for (token, mut buf) in bufs {
            buf.clear();
            let len = u32::try_from(buf.capacity()).unwrap_or(u32::MAX);
            wrs.push((
                RECV_WR_FLAG | token,
                Sge {
                    addr: buf.addr(),
                    len,
                    lkey: buf.lkey(),
                },
            ));
            self.recv.insert(token, buf);
        }
        // SAFETY: every SGE names a pool buffer registered read-write on
        // this QP's PD (the pool and QP share the device's PD; the endpoint
        // checks it) and owned by `self.recv` until its completion is seen
        // (`take_recv`) or the QP is destroyed (first field, dropped first).
        unsafe { self.qp.post_recv_sges(&wrs) }
    }

    /// The buffer of a completed (or flushed) receive WR, with its length
    /// set to `byte_len` (clamped to its capacity).
    pub(crate) fn take_recv(&mut self, wr_id: u64, byte_len: u32) -> Option<(u64, PoolBuf)> {
        let token = wr_id & !RECV_WR_FLAG;
        let mut buf = self.recv.remove(&token)?;
        buf.set_len((byte_len as usize).min(buf.capacity()));
        Some((token, buf))
    }

    /// Keeps `buf` as destination `token` for READs.
    pub(crate) fn add_dest(&mut self, token: u64, buf: PoolBuf) {
        self.dests.insert(token, buf);
    }

    /// The destination `token` with every READ into it complete; `None` if
    /// unknown or a READ into it is outstanding.
    pub(crate) fn take_dest(&mut self, token: u64) -> Option<PoolBuf> {
        if self.ledger.pinned(token) {
            return None;
        }
        self.dests.remove(&token)
    }

    /// Frees destination `token` now, or (through the ledger) once the
    /// READs into it completed or were flushed.
    pub(crate) fn release_dest(&mut self, token: u64) {
        if let Some(buf) = self.dests.remove(&token) {
            drop(self.ledger.release(token, Held::Dest(buf)));
        }
    }

    /// Gives message `token` up: freed now if no posted WR names it, by
    /// the ledger once the last such WR completed (or was flushed)
    /// otherwise.
    fn retire_send(&mut self, token: u64) -> bool {
        match self.sending.remove(&token) {
            Some(msg) => {
                drop(self.ledger.release(token, Held::Message(msg)));
                true
            }
            None => false,
        }
    }

    /// Keeps message `token` until [`release_send`](Self::release_send).
    pub(crate) fn add_send(&mut self, token: u64, msg: OutgoingMessage) {
        self.sending.insert(token, msg);
    }

    /// The peer is done with message `token` (or it was aborted): give it
    /// up, for a rendezvous once its window is invalidated (the LOCAL_INV
    /// goes out with the next [`post`](Self::post)). Its memory is freed
    /// only once no posted WR names it any more: an eager SEND still
    /// posted at an abort keeps it until its completion or flush
    /// ([`Ledger`]). Returns whether `token` was a message being sent.
    pub(crate) fn release_send(&mut self, token: u64) -> bool {
        if !self.sending.contains_key(&token) {
            return false;
        }
        if self.windows.bound.contains_key(&token) {
            self.windows.to_invalidate.push(token);
        } else {
            self.retire_send(token);
        }
        true
    }

    /// Messages and destinations given up while a posted WR still names
    /// them (held by the ledger until its completion or flush).
    pub(crate) fn retired(&self) -> usize {
        self.ledger.retired()
    }

    /// Messages held for sending (a rendezvous until its window is
    /// invalidated).
    pub(crate) fn sends_held(&self) -> usize {
        self.sending.len()
    }

    /// Messages held for sending that the peer has not taken yet: held
    /// ones minus rendezvous the peer DONE'd whose window is still being
    /// invalidated (taken; only our own clean-up is pending).
    pub(crate) fn sends_not_taken(&self) -> usize {
        self.sending
            .len()
            .saturating_sub(self.windows.invalidating.len() + self.windows.to_invalidate.len())
    }

    /// Memory windows this QP holds (free, bound and being invalidated).
    pub(crate) fn windows_held(&self) -> usize {
        self.windows.free.len() + self.windows.bound.len() + self.windows.invalidating.len()
    }

    /// The last window bound: (address, length, key) (for the guest tests).
    #[cfg_attr(not(tokio_rdma_guest), allow(dead_code))]
    pub(crate) fn last_window(&self) -> Option<(u64, u64, u32)> {
        self.windows.last
    }

    /// Window binds posted so far.
    pub(crate) fn window_binds(&self) -> u64 {
        self.windows.binds
    }

    /// A bind or invalidation of ours (wr_id with [`MW_WR_FLAG`]) completed
    /// with `status`. A completed LOCAL_INV releases its message and frees
    /// its window for reuse. After a failure (the QP is in error, so the
    /// peer can use no key of it) the message stays held until the QP is
    /// torn down, windows first. Returns whether a message was released.
    pub(crate) fn window_completed(&mut self, wr_id: u64, status: u32) -> bool {
        let Some((token, window)) = self.windows.invalidating.remove(&wr_id) else {
            return false;
        };
        if status == 0 {
            self.windows.free.push(window);
            self.retire_send(token)
        } else {
            self.windows.bound.insert(token, window);
            false
        }
    }

    /// Whether send-queue WR `wr_id` (posted, not yet known complete) is an
    /// RDMA READ.
    pub(crate) fn is_read(&self, wr_id: u64) -> bool {
        self.ledger.op(wr_id) == Some(PostedOp::Read)
    }

    /// Send-queue WR `wr_id` completed (successfully or flushed): it and
    /// every earlier WR are done (RC ordering); the ledger frees what was
    /// given up while they were posted.
    pub(crate) fn send_completed(&mut self, wr_id: u64) {
        self.ledger.complete(wr_id);
    }

    /// The SGE of the last SEND with payload or READ posted.
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn last_sge(&self) -> Option<PostedSge> {
        self.last_sge
    }

    #[cfg(tokio_rdma_guest)]
    fn note_sge(&mut self, sge: Sge) {
        self.last_sge = Some(PostedSge {
            addr: sge.addr,
            len: sge.len,
            lkey: sge.lkey,
        });
    }

    #[cfg(not(tokio_rdma_guest))]
    fn note_sge(&mut self, _sge: Sge) {}

    /// Invalidates the windows of finished messages (signaled LOCAL_INVs),
    /// binds a window for each RTS in `batch` and writes its key into the
    /// header; returns the headers to post, in batch order.
    fn prepare_windows(&mut self, batch: &[MsgTransmit]) -> Result<Vec<[u8; RTS_HEADER_LEN]>> {
        for token in std::mem::take(&mut self.windows.to_invalidate) {
            let Some(window) = self.windows.bound.remove(&token) else {
                self.retire_send(token);
                continue;
            };
            let wr_id = self.windows.wr_id();
            let rkey = window.rkey();
            self.windows.invalidating.insert(wr_id, (token, window));
            self.qp.post_local_inv(wr_id, rkey, true)?;
        }
        let mut headers = Vec::new();
        for t in batch {
            let MsgTransmitKind::Rts { token, header, .. } = &t.kind else {
                continue;
            };
            let Some(msg) = self.sending.get(token) else {
                // Not a message of ours (the test hook's forged RTS): its
                // header goes out as it is.
                headers.push(*header);
                continue;
            };
            let mr = msg.raw_mr();
            if mr == 0 {
                return Err(internal(format!(
                    "message {token} has no memory region to bind a window on"
                )));
            }
            let (addr, len) = (msg.addr(), msg.len() as u64);
            let mut window = match self.windows.free.pop() {
                Some(w) => w,
                None => MemoryWindow::alloc(self.qp.device())?,
            };
            let wr_id = self.windows.wr_id();
            // SAFETY: `mr` is the live MR under the message (registered
            // with MW_BIND on this QP's PD by the pool); the message is held
            // in `self.sending` until the window's LOCAL_INV completed
            // (`window_completed`) or, on a failed connection, until this
            // struct drops, windows first.
            let rkey = unsafe {
                self.qp.post_bind_mw(
                    wr_id,
                    &mut window,
                    BindTarget { mr, addr, len },
                    WindowAccess::RemoteRead,
                    false,
                )
            };
            let rkey = match rkey {
                Ok(k) => k,
                Err(e) => {
                    self.windows.free.push(window);
                    return Err(e);
                }
            };
            self.windows.binds += 1;
            self.windows.last = Some((addr, len, rkey));
            self.windows.bound.insert(*token, window);
            let mut h = RtsHeader::decode(header)
                .ok_or_else(|| internal("the core built a short RTS header".into()))?;
            h.rkey = rkey;
            headers.push(h.encode());
        }
        Ok(headers)
    }

    /// Posts what the core asked for, all of it with one doorbell (after
    /// the window binds and invalidations it needs), and records every WR
    /// in the ledger with the owner of the memory its SGE names: all of
    /// them even when the post fails part way, since the NIC may have
    /// taken any WR before the one it refused.
    pub(crate) fn post(&mut self, batch: &[MsgTransmit]) -> Result<()> {
        let headers = self.prepare_windows(batch)?;
        let mut headers = headers.iter();
        let mut wrs = Vec::with_capacity(batch.len());
        let mut records = Vec::with_capacity(batch.len());
        let mut last_sge = None;
        for t in batch {
            let (op, pin) = match &t.kind {
                &MsgTransmitKind::Eager {
                    token,
                    len,
                    imm,
                    inline,
                } => {
                    let msg = self
                        .sending
                        .get(&token)
                        .ok_or_else(|| internal(format!("no message for token {token}")))?;
                    let data = msg
                        .as_slice()
                        .get(..len as usize)
                        .ok_or_else(|| internal(format!("message {token} shorter than {len}")))?;
                    let (payload, pin) = if len == 0 {
                        (SendPayload::None, None)
                    } else if inline {
                        // Copied into the WR at posting: nothing to hold.
                        (SendPayload::Inline(data), None)
                    } else {
                        let sge = Sge {
                            addr: msg.addr(),
                            len,
                            lkey: msg.lkey(),
                        };
                        last_sge = Some(sge);
                        (SendPayload::Sge(sge), Some(token))
                    };
                    ((SendOp::SendImm { payload, imm }, PostedOp::Send), pin)
                }
                MsgTransmitKind::Rts { imm, inline, .. } => {
                    let header = headers
                        .next()
                        .ok_or_else(|| internal("RTS without a prepared header".into()))?;
                    let payload = if *inline {
                        SendPayload::Inline(header)
                    } else {
                        // At most `send_depth` WRs are outstanding and
                        // wr_ids are consecutive, so slot `wr_id %
                        // send_depth` is not in use by another WR.
                        let off = (t.wr_id % self.send_depth) as usize * RTS_SLOT;
                        let scratch = self
                            .qp
                            .send_buf_mut()
                            .ok_or_else(|| internal("message QP without its RTS scratch".into()))?;
                        scratch
                            .write_at(off, header)
                            .map_err(|source| Error::Verbs {
                                op: "RTS scratch",
                                source,
                            })?;
                        SendPayload::Sge(Sge {
                            addr: scratch.addr() + off as u64,
                            len: RTS_HEADER_LEN as u32,
                            lkey: scratch.lkey(),
                        })
                    };
                    // The scratch is the QP's own, held for its life.
                    let op = SendOp::SendImm { payload, imm: *imm };
                    ((op, PostedOp::Send), None)
                }
                &MsgTransmitKind::Control { imm } => {
                    let op = SendOp::SendImm {
                        payload: SendPayload::None,
                        imm,
                    };
                    ((op, PostedOp::Send), None)
                }
                &MsgTransmitKind::Read {
                    local_token,
                    local_offset,
                    remote_addr,
                    rkey,
                    len,
                } => {
                    let dest = self
                        .dests
                        .get(&local_token)
                        .ok_or_else(|| internal(format!("no destination {local_token}")))?;
                    let end = local_offset.checked_add(u64::from(len));
                    if end.is_none_or(|e| e > dest.capacity() as u64) {
                        return Err(internal(format!(
                            "READ of {len} bytes at {local_offset} beyond destination of {} bytes",
                            dest.capacity()
                        )));
                    }
                    let local = Sge {
                        addr: dest.addr() + local_offset,
                        len,
                        lkey: dest.lkey(),
                    };
                    last_sge = Some(local);
                    let op = SendOp::Read {
                        local,
                        remote_addr,
                        rkey,
                    };
                    ((op, PostedOp::Read), Some(local_token))
                }
            };
            let (op, posted) = op;
            wrs.push(SendWr {
                wr_id: t.wr_id,
                signaled: t.signaled,
                solicited: t.solicited,
                op,
            });
            records.push((t.wr_id, posted, pin));
        }
        // SAFETY: every SGE names registered memory on this QP's PD that
        // outlives its WR: a message or destination whose token the ledger
        // records below as named by this WR, so that giving it up before
        // the WR's completion or flush leaves it with the ledger (a field
        // dropped after the QP is destroyed); the QP's own RTS scratch; a
        // destination inside its bounds (checked above) that `take_dest`
        // hands out only once no READ into it is outstanding. A SEND only
        // reads its message; a READ's destination is not read by the
        // program while pinned. Inline payloads are copied at posting.
        let posted = unsafe { self.qp.post_send_batch(&wrs) };
        drop(wrs);
        for (wr_id, op, pin) in records {
            self.ledger.record(wr_id, op, pin);
        }
        if let Some(sge) = last_sge {
            self.note_sge(sge);
        }
        posted
    }
}
