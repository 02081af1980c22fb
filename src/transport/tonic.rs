//! Feature `tonic`: the server's `Connected` for [`Stream`] and a client
//! channel over any transport.

use tonic::transport::{Channel, Endpoint};

use super::{ConnectionInfo, Connector, Stream, TransportAddr};
use crate::RdmaConfig;

/// Lets tonic serve [`Stream`]s (`Server::serve_with_incoming` with
/// [`Listener::into_incoming`](super::Listener::into_incoming)); handlers
/// find the [`ConnectionInfo`] in the request's extensions
/// (`request.extensions().get::<ConnectionInfo>()`).
impl tonic::transport::server::Connected for Stream {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> ConnectionInfo {
        self.connection_info_lossy()
    }
}

/// Connects a tonic [`Channel`] to `addr` (`tcp://`, `rdma://` or
/// `auto://host:port`) with `config` for RDMA: an `Endpoint` for
/// `http://host:port` and [`Connector`] through
/// `Endpoint::connect_with_connector`. Use those two directly to set other
/// `Endpoint` options.
///
/// # Errors
/// tonic's transport error when the first connection fails (its source is
/// the `io::Error` of [`Stream::connect_with`]).
pub async fn channel(
    addr: &TransportAddr,
    config: &RdmaConfig,
) -> Result<Channel, tonic::transport::Error> {
    let host = if addr.host().contains(':') {
        format!("[{}]", addr.host())
    } else {
        addr.host().to_string()
    };
    let endpoint = Endpoint::from_shared(format!("http://{host}:{}", addr.port()))?;
    endpoint
        .connect_with_connector(Connector::with_config(addr.transport(), config.clone()))
        .await
}
