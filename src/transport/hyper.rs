//! Feature `hyper`: a connector for `hyper_util`'s pooled client.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;

use super::{ConnectionInfo, Stream, Transport, TransportAddr};
use crate::RdmaConfig;

/// A `tower_service::Service<http::Uri>` that opens [`Stream`]s: the
/// connector for `hyper_util::client::legacy::Client` (and for tonic's
/// `Endpoint::connect_with_connector`).
///
/// The transport comes from the URI's scheme: `rdma://`, `tcp://` and
/// `auto://` choose it (and mean plain HTTP on the wire; hyper sends them
/// like `http://`), while `http://` and `https://` use the connector's own
/// transport ([`new`](Self::new)). A missing port is 80 (443 for `https`).
/// With `https` the stream is plain; wrap this connector in a TLS connector
/// (for example hyper-rustls) for TLS.
///
/// The response is `TokioIo<Stream>`; its `connected()` carries a
/// [`ConnectionInfo`](super::ConnectionInfo) in `Connected::extra`, which the
/// client puts into each response's extensions. Clients that do not
/// (tonic's `Channel`) can ask the connector:
/// [`last_connection`](Self::last_connection).
///
/// # Errors
/// A connect fails with the `io::Error` of
/// [`Stream::connect_with`](super::Stream::connect_with) (a
/// `tokio_rdma::Error` payload, [`crate::Error::find`] through hyper's
/// wrappers); a URI with another scheme or without a host is
/// `InvalidInput` with a plain message naming the URI.
///
/// Arguments: constructors that keep a config take it by value
/// ([`with_config`](Self::with_config)); functions that use one for a
/// single call borrow it (`Stream::connect_with(addr, &config)`).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use http_body_util::Empty;
/// use hyper_util::client::legacy::Client;
/// use hyper_util::rt::TokioExecutor;
/// use tokio_rdma::transport::{ConnectionInfo, Connector, Transport};
///
/// let client = Client::builder(TokioExecutor::new())
///     .build::<_, Empty<bytes::Bytes>>(Connector::new(Transport::Auto));
/// let res = client.get("http://10.11.0.1:8080/".parse()?).await?;
/// let info = res.extensions().get::<ConnectionInfo>().unwrap();
/// println!("{} via {}", info.peer, info.transport);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Connector {
    transport: Transport,
    config: Arc<RdmaConfig>,
    nodelay: bool,
    /// Shared by clones: hyper and tonic clone the connector they are given.
    last: Arc<Mutex<Option<ConnectionInfo>>>,
}

impl Connector {
    /// A connector whose `http://` URIs use `transport`, with the default
    /// [`RdmaConfig`] and `TCP_NODELAY` off (as `HttpConnector`).
    pub fn new(transport: Transport) -> Self {
        Self::with_config(transport, RdmaConfig::default())
    }

    /// A connector whose RDMA connections use `config`.
    pub fn with_config(transport: Transport, config: RdmaConfig) -> Self {
        Connector {
            transport,
            config: Arc::new(config),
            nodelay: false,
            last: Arc::default(),
        }
    }

    /// The [`ConnectionInfo`] of the newest connection this connector (or
    /// any clone of it) opened, `None` before the first. A tonic `Channel`
    /// holds one connection at a time (a reconnect opens a new one), so for
    /// a connector given to `Endpoint::connect_with_connector` this is the
    /// channel's transport and peer.
    pub fn last_connection(&self) -> Option<ConnectionInfo> {
        *self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets `TCP_NODELAY` on every connection it opens (default `false`; a
    /// no-op over RDMA, which never delays writes).
    pub fn set_nodelay(&mut self, nodelay: bool) {
        self.nodelay = nodelay;
    }

    /// The transport used for `http://` and `https://` URIs.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// The address `uri` names: its transport (scheme, or the connector's
    /// for `http`/`https`), host and port.
    ///
    /// # Errors
    /// `InvalidInput` for a URI without a host or with another scheme.
    pub fn target(&self, uri: &Uri) -> io::Result<TransportAddr> {
        let invalid = |what: &str| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cannot connect to {uri}: {what}"),
            )
        };
        let scheme = uri.scheme_str().ok_or_else(|| invalid("no scheme"))?;
        let (transport, default_port) = if scheme.eq_ignore_ascii_case("http") {
            (self.transport, 80)
        } else if scheme.eq_ignore_ascii_case("https") {
            (self.transport, 443)
        } else if let Some(t) = Transport::from_scheme(scheme) {
            (t, 80)
        } else {
            return Err(invalid("scheme is not http, https, tcp, rdma or auto"));
        };
        let host = uri
            .host()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| invalid("no host"))?;
        Ok(TransportAddr::new(
            transport,
            host,
            uri.port_u16().unwrap_or(default_port),
        ))
    }
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<Stream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<Stream>>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let target = self.target(&uri);
        let config = self.config.clone();
        let nodelay = self.nodelay;
        let last = Arc::clone(&self.last);
        Box::pin(async move {
            let stream = Stream::connect_with(target?, &config).await?;
            if nodelay {
                stream.set_nodelay(true)?;
            }
            *last.lock().unwrap_or_else(|p| p.into_inner()) = Some(stream.connection_info_lossy());
            Ok(TokioIo::new(stream))
        })
    }
}

/// `TokioIo<Stream>` gets this through hyper_util's blanket impl.
impl Connection for Stream {
    fn connected(&self) -> Connected {
        Connected::new().extra(self.connection_info_lossy())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_from_uri() {
        let c = Connector::new(Transport::Rdma);
        let t = |s: &str| c.target(&s.parse().unwrap());
        assert_eq!(
            t("http://10.0.0.1:8080/x").unwrap(),
            TransportAddr::new(Transport::Rdma, "10.0.0.1", 8080)
        );
        assert_eq!(
            t("https://h/").unwrap(),
            TransportAddr::new(Transport::Rdma, "h", 443)
        );
        assert_eq!(
            t("tcp://h:1").unwrap(),
            TransportAddr::new(Transport::Tcp, "h", 1)
        );
        assert_eq!(
            t("auto://[::1]/").unwrap(),
            TransportAddr::new(Transport::Auto, "::1", 80)
        );
        assert_eq!(
            t("ftp://h:1").unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(t("/path").unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}
