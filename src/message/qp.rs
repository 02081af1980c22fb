//! The queue pair of a message endpoint, owning every buffer the NIC may
//! touch: receive buffers while posted, rendezvous destinations while an
//! RDMA READ into them is outstanding, and the messages being sent.
//!
//! Buffers are named by the runtime's tokens (those of
//! `MessageCore`). The runtime can only
//! take a buffer back once the NIC is done with it: a receive buffer after
//! its completion, a destination once no READ into it is outstanding. So
//! the `unsafe` of posting work requests (WRs) with scatter/gather elements
//! (SGEs) stays here, in the one module of the message runtime that opts
//! into `unsafe` (a scoped `allow`, each block with its `SAFETY:` comment).
//! Field order makes the QP be destroyed before any buffer is freed.

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};
use crate::pool::{OutgoingMessage, PoolBuf};
use crate::proto::message::{MsgTransmit, MsgTransmitKind, RTS_HEADER_LEN, RtsHeader};
use crate::verbs::mw::{MemoryWindow, WindowAccess};
use crate::verbs::rc::{
    BindTarget, MW_WR_FLAG, RECV_WR_FLAG, RcQueuePair, SendOp, SendPayload, SendWr, Sge,
};

/// Bytes of scratch per send-queue slot for an RTS header that is not
/// posted inline.
const RTS_SLOT: usize = 32;

/// The SGE of the last data WR posted (a SEND with payload or a READ), for
/// the zero-copy checks of the test suite.
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
    send_depth: u64,
    /// Posted receive buffers by token.
    recv: HashMap<u64, PoolBuf>,
    /// Rendezvous destinations by token.
    dests: HashMap<u64, PoolBuf>,
    /// Destinations released while READs into them were outstanding.
    zombies: HashMap<u64, PoolBuf>,
    /// Messages being sent, by token.
    sending: HashMap<u64, OutgoingMessage>,
    /// Posted send-queue WRs not known complete, oldest first, with the
    /// destination a READ writes into.
    outstanding: VecDeque<(u64, Option<u64>)>,
    last_sge: Option<PostedSge>,
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
            send_depth: u64::from(send_depth.max(1)),
            recv: HashMap::new(),
            dests: HashMap::new(),
            zombies: HashMap::new(),
            sending: HashMap::new(),
            outstanding: VecDeque::new(),
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

    fn dest_busy(&self, token: u64) -> bool {
        self.outstanding.iter().any(|&(_, d)| d == Some(token))
    }

    /// The destination `token` with every READ into it complete; `None` if
    /// unknown or a READ into it is outstanding.
    pub(crate) fn take_dest(&mut self, token: u64) -> Option<PoolBuf> {
        if self.dest_busy(token) {
            return None;
        }
        self.dests.remove(&token)
    }

    /// Frees destination `token` now, or once the READs into it completed.
    pub(crate) fn release_dest(&mut self, token: u64) {
        if let Some(buf) = self.dests.remove(&token) {
            if self.dest_busy(token) {
                self.zombies.insert(token, buf);
            }
        }
    }

    /// Keeps message `token` until [`release_send`](Self::release_send).
    pub(crate) fn add_send(&mut self, token: u64, msg: OutgoingMessage) {
        self.sending.insert(token, msg);
    }

    /// The NIC and the peer are done with message `token` (or it was
    /// aborted): drop it, at once for an eager message, once its window is
    /// invalidated for a rendezvous (the LOCAL_INV goes out with the next
    /// [`post`](Self::post)). Returns whether `token` was a message being
    /// sent.
    pub(crate) fn release_send(&mut self, token: u64) -> bool {
        if !self.sending.contains_key(&token) {
            return false;
        }
        if self.windows.bound.contains_key(&token) {
            self.windows.to_invalidate.push(token);
        } else {
            self.sending.remove(&token);
        }
        true
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
            self.sending.remove(&token).is_some()
        } else {
            self.windows.bound.insert(token, window);
            false
        }
    }

    /// Whether send-queue WR `wr_id` (posted, not yet known complete) is an
    /// RDMA READ.
    pub(crate) fn is_read(&self, wr_id: u64) -> bool {
        self.outstanding
            .iter()
            .any(|&(id, dest)| id == wr_id && dest.is_some())
    }

    /// Send-queue WR `wr_id` completed (successfully or flushed): it and
    /// every earlier WR are done (RC ordering).
    pub(crate) fn send_completed(&mut self, wr_id: u64) {
        while let Some(&(id, _)) = self.outstanding.front() {
            if id > wr_id {
                break;
            }
            self.outstanding.pop_front();
        }
        if !self.zombies.is_empty() {
            let busy: Vec<u64> = self.outstanding.iter().filter_map(|&(_, d)| d).collect();
            self.zombies.retain(|t, _| busy.contains(t));
        }
    }

    /// The SGE of the last SEND with payload or READ posted.
    pub(crate) fn last_sge(&self) -> Option<PostedSge> {
        self.last_sge
    }

    /// Invalidates the windows of finished messages (signaled LOCAL_INVs),
    /// binds a window for each RTS in `batch` and writes its key into the
    /// header; returns the headers to post, in batch order.
    fn prepare_windows(&mut self, batch: &[MsgTransmit]) -> Result<Vec<[u8; RTS_HEADER_LEN]>> {
        for token in std::mem::take(&mut self.windows.to_invalidate) {
            let Some(window) = self.windows.bound.remove(&token) else {
                self.sending.remove(&token);
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
    /// the window binds and invalidations it needs).
    pub(crate) fn post(&mut self, batch: &[MsgTransmit]) -> Result<()> {
        let headers = self.prepare_windows(batch)?;
        let mut headers = headers.iter();
        let mut wrs = Vec::with_capacity(batch.len());
        let mut dests = Vec::with_capacity(batch.len());
        for t in batch {
            let mut read_dest = None;
            let op = match &t.kind {
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
                    let payload = if len == 0 {
                        SendPayload::None
                    } else if inline {
                        SendPayload::Inline(data)
                    } else {
                        let sge = Sge {
                            addr: msg.addr(),
                            len,
                            lkey: msg.lkey(),
                        };
                        self.last_sge = Some(PostedSge {
                            addr: sge.addr,
                            len,
                            lkey: sge.lkey,
                        });
                        SendPayload::Sge(sge)
                    };
                    SendOp::SendImm { payload, imm }
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
                            .send_buf()
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
                    SendOp::SendImm { payload, imm: *imm }
                }
                &MsgTransmitKind::Control { imm } => SendOp::SendImm {
                    payload: SendPayload::None,
                    imm,
                },
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
                    self.last_sge = Some(PostedSge {
                        addr: local.addr,
                        len,
                        lkey: local.lkey,
                    });
                    read_dest = Some(local_token);
                    SendOp::Read {
                        local,
                        remote_addr,
                        rkey,
                    }
                }
            };
            wrs.push(SendWr {
                wr_id: t.wr_id,
                signaled: t.signaled,
                solicited: t.solicited,
                op,
            });
            dests.push((t.wr_id, read_dest));
        }
        // SAFETY: every SGE names registered memory on this QP's PD that
        // outlives its WR: a message held in `self.sending` until the core
        // reports its send done (a SEND only reads it) and, for a
        // rendezvous, until its window is invalidated; the QP's own RTS
        // scratch; a destination inside its bounds (checked above), held in
        // `self.dests`/`self.zombies` while a READ into it is outstanding
        // (`dest_busy`, fed by `self.outstanding` below). Inline payloads
        // are copied at posting.
        unsafe { self.qp.post_send_batch(&wrs) }?;
        self.outstanding.extend(dests);
        Ok(())
    }
}
