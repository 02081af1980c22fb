//! Active side of the rdma_cm handshake (client).

use std::net::SocketAddr;
use std::sync::Arc;

use rdma_mummy_sys::ibv_qp_state;
use tracing::debug;

use super::conn::{self, Conn, Established};
use crate::config::RdmaConfig;
use crate::error::{Error, Result};
use crate::proto::handshake::{EndpointKind, Hello, decode_reject, encode_reject};
use crate::verbs::cm::{CmEvent, CmEventKind, CmId, EventChannel};

/// IB CM reject reason "consumer reject" (IBTA vol. 1, 12.6.7.2, table 112):
/// the remote application called `rdma_reject`.
const IB_CM_REJ_CONSUMER_DEFINED: i32 = 28;

pub(crate) async fn connect(addr: SocketAddr, cfg: &RdmaConfig) -> Result<Arc<Conn>> {
    match tokio::time::timeout(cfg.connect_timeout, connect_inner(addr, cfg)).await {
        Ok(r) => r,
        Err(_) => Err(Error::TimedOut { addr }),
    }
}

async fn expect(
    channel: &Arc<EventChannel>,
    addr: SocketAddr,
    want: CmEventKind,
) -> Result<CmEvent> {
    let ev = channel.next().await.map_err(|source| Error::Verbs {
        op: "rdma_get_cm_event",
        source,
    })?;
    if ev.kind == want {
        return Ok(ev);
    }
    debug!(kind = ?ev.kind, status = ev.status, "connect failed");
    Err(match ev.kind {
        CmEventKind::AddrError | CmEventKind::RouteError => Error::Unreachable {
            addr,
            source: std::io::Error::from_raw_os_error(-ev.status),
        },
        CmEventKind::Rejected => match decode_reject(&ev.private_data) {
            Some((server_version, reason)) if ev.status == IB_CM_REJ_CONSUMER_DEFINED => {
                Error::HandshakeRejected {
                    addr,
                    reason,
                    server_version,
                }
            }
            _ => Error::ConnectionRefused { addr },
        },
        CmEventKind::Unreachable | CmEventKind::ConnectError => Error::ConnectionRefused { addr },
        _ => Error::Verbs {
            op: "rdma_connect",
            source: std::io::Error::other(format!("unexpected rdma_cm event {:?}", ev.kind)),
        },
    })
}

async fn connect_inner(addr: SocketAddr, cfg: &RdmaConfig) -> Result<Arc<Conn>> {
    // Fail fast with the foundation's typed error on hosts without RDMA.
    crate::verbs::devices()?;
    let channel = EventChannel::new()?;
    let id = CmId::new(&channel)?;
    id.resolve_addr(addr, cfg.resolve_timeout)
        .map_err(|e| match e {
            Error::Verbs { source, .. } => Error::Unreachable { addr, source },
            e => e,
        })?;
    expect(&channel, addr, CmEventKind::AddrResolved).await?;
    id.resolve_route(cfg.resolve_timeout).map_err(|e| match e {
        Error::Verbs { source, .. } => Error::Unreachable { addr, source },
        e => e,
    })?;
    expect(&channel, addr, CmEventKind::RouteResolved).await?;

    let (_dev, mut qp, device) = conn::new_qp(&id, cfg)?;
    qp.connect_from_cm(&id, true)?;
    let hello = conn::local_hello(&qp, cfg);
    id.connect(qp.qp_num(), &hello.encode())?;
    let ev = expect(&channel, addr, CmEventKind::ConnectResponse).await?;
    let peer = match Hello::decode(&ev.private_data)
        .and_then(|h| h.expect_kind(EndpointKind::ByteStream))
    {
        Ok(h) => h,
        Err(e) => {
            // The server is not a tokio-rdma stream listener we understand:
            // refuse to complete the connection and tell it why.
            let _ = id.reject(&encode_reject(e.reject_reason()));
            let _ = id.disconnect();
            return Err(Error::Handshake(e));
        }
    };
    // Before the reply, rdma_cm's INIT attributes carry no remote access
    // rights; re-apply INIT with the attributes of the now-known connection
    // (what librdmacm's own ucma_modify_qp_rtr does), then RTR and RTS.
    qp.modify_from_cm(&id, ibv_qp_state::IBV_QPS_INIT)?;
    qp.modify_from_cm(&id, ibv_qp_state::IBV_QPS_RTR)?;
    qp.modify_from_cm(&id, ibv_qp_state::IBV_QPS_RTS)?;
    id.establish()?;
    conn::spawn(
        Established {
            id,
            qp,
            peer,
            device,
            fallback_addr: addr,
        },
        cfg,
    )
}

/// Test hook: a connect request with arbitrary private data. `Ok(())` if the
/// server accepted (the connection is then dropped), the server's answer as
/// an error otherwise.
#[cfg(feature = "guest-tests")]
pub(crate) async fn raw_connect(addr: SocketAddr, private_data: &[u8]) -> Result<()> {
    let cfg = RdmaConfig::default();
    let channel = EventChannel::new()?;
    let id = CmId::new(&channel)?;
    id.resolve_addr(addr, cfg.resolve_timeout)?;
    expect(&channel, addr, CmEventKind::AddrResolved).await?;
    id.resolve_route(cfg.resolve_timeout)?;
    expect(&channel, addr, CmEventKind::RouteResolved).await?;
    let (_dev, mut qp, _device) = conn::new_qp(&id, &cfg)?;
    qp.connect_from_cm(&id, true)?;
    id.connect(qp.qp_num(), private_data)?;
    expect(&channel, addr, CmEventKind::ConnectResponse).await?;
    let _ = id.disconnect();
    Ok(())
}
