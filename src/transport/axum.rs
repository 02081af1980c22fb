//! Feature `axum`: `axum::serve::Listener` for [`Listener`] and
//! `ConnectInfo<ConnectionInfo>`.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use tracing::{error, warn};

use super::{ConnectionInfo, Listener, Stream};

/// `axum::serve(listener, app)` over TCP, RDMA or both.
///
/// As axum's own listeners, `accept` never fails: a per-connection error
/// (`ConnectionRefused`, `ConnectionReset`) is skipped, `ConnectionAborted`
/// (also what a dead RDMA listener task reports) is logged and retried after
/// 10 ms, and any other error (for example `EMFILE`) is logged and retried
/// after 1 s.
impl axum::serve::Listener for Listener {
    type Io = Stream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Stream, SocketAddr) {
        loop {
            match Listener::accept(self).await {
                Ok(x) => return x,
                Err(e) => match e.kind() {
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset => {}
                    io::ErrorKind::ConnectionAborted => {
                        warn!(error = %e, "accept error");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    _ => {
                        error!(error = %e, "accept error");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                },
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Listener::local_addr(self)
    }
}

/// `Router::into_make_service_with_connect_info::<ConnectionInfo>()` makes
/// `ConnectInfo<ConnectionInfo>` available to handlers: the peer's address,
/// the local address and the transport of the connection.
impl Connected<IncomingStream<'_, Listener>> for ConnectionInfo {
    fn connect_info(stream: IncomingStream<'_, Listener>) -> Self {
        let mut info = stream.io().connection_info_lossy();
        info.peer = *stream.remote_addr();
        info
    }
}
