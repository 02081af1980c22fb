//! Feature `tonic`: the server's `Connected` for [`Stream`] and a client
//! channel over any transport.

use std::io;

use tonic::transport::{Channel, Endpoint};

use super::{ConnectionInfo, Connector, Stream, ToTransportAddr};
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
/// `auto://host:port`, a string or a [`TransportAddr`](super::TransportAddr))
/// with the default [`RdmaConfig`]. See [`channel_with`].
///
/// # Errors
/// As [`channel_with`].
pub async fn channel(addr: impl ToTransportAddr) -> io::Result<Channel> {
    channel_with(addr, &RdmaConfig::default()).await
}

/// Connects a tonic [`Channel`] to `addr`; RDMA connections use `config`.
///
/// It is an `Endpoint` for `http://host:port` connected through
/// [`Connector`] (`Endpoint::connect_with_connector`). To set other
/// `Endpoint` options, or to learn which transport the channel's
/// connection runs on (tonic's client responses carry no connection
/// information), use the two directly and ask the connector
/// ([`Connector::last_connection`]):
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tokio_rdma::transport::{Connector, Transport};
///
/// let connector = Connector::new(Transport::Auto);
/// let channel = tonic::transport::Endpoint::from_static("http://10.11.0.1:50051")
///     .connect_with_connector(connector.clone())
///     .await?;
/// let info = connector.last_connection().expect("connected");
/// println!("channel to {} runs on {}", info.peer, info.transport);
/// # drop(channel); Ok(()) }
/// ```
///
/// # Errors
/// `InvalidInput` for a string that is not a transport address (the
/// source is an [`AddrParseError`](super::AddrParseError)). When the first
/// connection fails, an `io::Error` with the connect error's kind (for
/// example `ConnectionRefused`) whose message names the address and the
/// whole cause (`tonic channel to tcp://10.0.0.5:50051: transport error:
/// connect tcp://10.0.0.5:50051: Connection refused (os error 111)`);
/// [`crate::Error::find`] reaches the crate's error inside.
pub async fn channel_with(addr: impl ToTransportAddr, config: &RdmaConfig) -> io::Result<Channel> {
    let addr = addr.to_transport_addr()?;
    let host = if addr.host().contains(':') {
        format!("[{}]", addr.host())
    } else {
        addr.host().to_string()
    };
    let endpoint = Endpoint::from_shared(format!("http://{host}:{}", addr.port()))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    endpoint
        .connect_with_connector(Connector::with_config(addr.transport(), config.clone()))
        .await
        .map_err(|source| {
            io::Error::new(
                connect_error_kind(&source),
                ChannelError {
                    addr: addr.to_string(),
                    source,
                },
            )
        })
}

/// tonic's connect error with the address; its message spells out the
/// whole source chain (tonic's own says only "transport error").
#[derive(Debug)]
struct ChannelError {
    addr: String,
    source: tonic::transport::Error,
}

impl std::fmt::Display for ChannelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tonic channel to {}: {}", self.addr, self.source)?;
        let mut last = self.source.to_string();
        let mut cur = std::error::Error::source(&self.source);
        while let Some(e) = cur {
            let msg = e.to_string();
            // Errors that already print their source are not repeated.
            if !last.ends_with(&msg) {
                write!(f, ": {msg}")?;
            }
            last = msg;
            cur = e.source();
        }
        Ok(())
    }
}

impl std::error::Error for ChannelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// The kind of the first `io::Error` in `e`'s source chain (the
/// connector's error), or `Other`.
fn connect_error_kind(e: &tonic::transport::Error) -> io::ErrorKind {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            return io.kind();
        }
        cur = err.source();
    }
    io::ErrorKind::Other
}
