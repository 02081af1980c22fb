//! Transport addresses: `rdma://host:port`, `tcp://host:port`,
//! `auto://host:port`, parsed with [`http::Uri`].

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::str::FromStr;

use http::Uri;

/// Which transport a connection or listener uses.
///
/// [`Tcp`](Self::Tcp) and [`Rdma`](Self::Rdma) name what a connection
/// actually runs on ([`Stream::transport`](super::Stream::transport) only
/// returns these two). [`Auto`](Self::Auto) is a request: a client tries RDMA
/// and falls back to TCP; a listener serves both on one port number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// The kernel's TCP ([`tokio::net::TcpStream`]). Scheme `tcp://`.
    Tcp,
    /// An RDMA reliable-connected queue pair ([`crate::RdmaStream`]).
    /// Scheme `rdma://`.
    Rdma,
    /// RDMA where it works, TCP otherwise. Scheme `auto://`.
    Auto,
}

impl Transport {
    /// The URI scheme naming this transport: `"tcp"`, `"rdma"` or `"auto"`.
    pub fn scheme(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
            Transport::Auto => "auto",
        }
    }

    /// The transport a scheme names (`tcp`, `rdma`, `auto`, ASCII
    /// case-insensitive), or `None` for any other scheme.
    pub fn from_scheme(scheme: &str) -> Option<Transport> {
        [Transport::Tcp, Transport::Rdma, Transport::Auto]
            .into_iter()
            .find(|t| scheme.eq_ignore_ascii_case(t.scheme()))
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.scheme())
    }
}

/// Why a string is not a valid [`TransportAddr`].
///
/// Converts into an [`io::Error`] of kind [`io::ErrorKind::InvalidInput`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddrParseError {
    /// The string is not a URI at all (the message is `http::Uri`'s).
    #[error("invalid transport address {input:?}: {message}")]
    InvalidUri {
        /// The string that was parsed.
        input: String,
        /// What the URI parser reported.
        message: String,
    },
    /// No scheme: write `tcp://`, `rdma://` or `auto://` in front.
    #[error("transport address {input:?} has no scheme (expected tcp://, rdma:// or auto://)")]
    MissingScheme {
        /// The string that was parsed.
        input: String,
    },
    /// A scheme other than `tcp`, `rdma` and `auto`.
    #[error("unknown transport scheme {scheme:?} in {input:?} (expected tcp, rdma or auto)")]
    UnknownScheme {
        /// The string that was parsed.
        input: String,
        /// The scheme found.
        scheme: String,
    },
    /// No host (for example `tcp://:80`).
    #[error("transport address {input:?} has no host")]
    MissingHost {
        /// The string that was parsed.
        input: String,
    },
    /// No port, or not a number in 0..=65535: a transport address always
    /// names one (`0` picks a free one when binding).
    #[error("transport address {input:?} has no port (a number in 0..=65535)")]
    MissingPort {
        /// The string that was parsed.
        input: String,
    },
    /// A path, query or user info after the authority (only `host:port` and
    /// an optional trailing `/` are allowed).
    #[error("transport address {input:?} must be scheme://host:port, nothing else")]
    UnexpectedPart {
        /// The string that was parsed.
        input: String,
    },
}

impl From<AddrParseError> for io::Error {
    fn from(err: AddrParseError) -> Self {
        io::Error::new(io::ErrorKind::InvalidInput, err)
    }
}

/// A transport and a `host:port`: what [`Stream::connect`] dials and
/// [`Listener::bind`] binds.
///
/// Written as `tcp://host:port`, `rdma://host:port` or `auto://host:port`
/// (IPv6 hosts in brackets, `rdma://[fe80::1]:7471`). The host may be a name;
/// it is resolved when connecting or binding. Parsing uses [`http::Uri`].
///
/// ```
/// use tokio_rdma::transport::{Transport, TransportAddr};
///
/// let addr: TransportAddr = "rdma://10.11.0.1:7471".parse().unwrap();
/// assert_eq!(addr.transport(), Transport::Rdma);
/// assert_eq!(addr.host(), "10.11.0.1");
/// assert_eq!(addr.port(), 7471);
/// assert_eq!(addr.to_string(), "rdma://10.11.0.1:7471");
/// assert!("udp://10.11.0.1:7471".parse::<TransportAddr>().is_err());
/// ```
///
/// [`Stream::connect`]: super::Stream::connect
/// [`Listener::bind`]: super::Listener::bind
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TransportAddr {
    transport: Transport,
    /// Without IPv6 brackets.
    host: String,
    port: u16,
}

impl TransportAddr {
    /// An address from its parts. `host` is a name or an IP address (IPv6
    /// with or without brackets).
    pub fn new(transport: Transport, host: impl Into<String>, port: u16) -> Self {
        let mut host = host.into();
        if host.starts_with('[') && host.ends_with(']') {
            host = host[1..host.len() - 1].to_string();
        }
        TransportAddr {
            transport,
            host,
            port,
        }
    }

    /// An address for a resolved socket address.
    pub fn from_socket_addr(transport: Transport, addr: SocketAddr) -> Self {
        TransportAddr::new(transport, addr.ip().to_string(), addr.port())
    }

    /// The requested transport.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// The host: a name or an IP address, IPv6 without brackets.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port (TCP port, or rdma_cm port for RDMA; the same number for
    /// both in auto mode).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The same host and port with another transport.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// The same transport and host with another port.
    pub fn with_port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    /// `(host, port)` for [`tokio::net::lookup_host`] and the `connect` and
    /// `bind` functions of tokio and this crate.
    pub fn host_port(&self) -> (&str, u16) {
        (&self.host, self.port)
    }
}

impl fmt::Display for TransportAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "{}://[{}]:{}", self.transport, self.host, self.port)
        } else {
            write!(f, "{}://{}:{}", self.transport, self.host, self.port)
        }
    }
}

impl FromStr for TransportAddr {
    type Err = AddrParseError;

    fn from_str(input: &str) -> Result<Self, AddrParseError> {
        let uri: Uri = input.parse().map_err(|e: http::uri::InvalidUri| {
            if !input.contains("://") {
                AddrParseError::MissingScheme {
                    input: input.to_string(),
                }
            } else {
                AddrParseError::InvalidUri {
                    input: input.to_string(),
                    message: e.to_string(),
                }
            }
        })?;
        let scheme = uri
            .scheme_str()
            .ok_or_else(|| AddrParseError::MissingScheme {
                input: input.to_string(),
            })?;
        let transport =
            Transport::from_scheme(scheme).ok_or_else(|| AddrParseError::UnknownScheme {
                input: input.to_string(),
                scheme: scheme.to_string(),
            })?;
        parse_authority(input, &uri, transport)
    }
}

/// The host and port of `uri`, which must have nothing else besides its
/// scheme (a path of `/` is allowed).
fn parse_authority(
    input: &str,
    uri: &Uri,
    transport: Transport,
) -> Result<TransportAddr, AddrParseError> {
    let authority = uri.authority().ok_or_else(|| AddrParseError::MissingHost {
        input: input.to_string(),
    })?;
    if authority.as_str().contains('@') || uri.query().is_some() || !matches!(uri.path(), "" | "/")
    {
        return Err(AddrParseError::UnexpectedPart {
            input: input.to_string(),
        });
    }
    if authority.host().is_empty() {
        return Err(AddrParseError::MissingHost {
            input: input.to_string(),
        });
    }
    let port = authority
        .port_u16()
        .ok_or_else(|| AddrParseError::MissingPort {
            input: input.to_string(),
        })?;
    Ok(TransportAddr::new(transport, authority.host(), port))
}

impl TryFrom<&str> for TransportAddr {
    type Error = AddrParseError;

    fn try_from(s: &str) -> Result<Self, AddrParseError> {
        s.parse()
    }
}

/// Things [`Stream::connect`](super::Stream::connect) and
/// [`Listener::bind`](super::Listener::bind) accept as an address: a
/// [`TransportAddr`] or a string to parse as one. A `SocketAddr` names no
/// transport, so it is not one: use
/// [`TransportAddr::from_socket_addr`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a transport address",
    note = "pass a string such as \"auto://10.0.0.5:8080\" (tcp://, rdma:// or auto://) or a `TransportAddr`; from a `SocketAddr`: `TransportAddr::from_socket_addr(Transport::Auto, addr)`"
)]
pub trait ToTransportAddr {
    /// The address, or why the string is not one.
    fn to_transport_addr(&self) -> Result<TransportAddr, AddrParseError>;
}

impl ToTransportAddr for TransportAddr {
    fn to_transport_addr(&self) -> Result<TransportAddr, AddrParseError> {
        Ok(self.clone())
    }
}

impl ToTransportAddr for str {
    fn to_transport_addr(&self) -> Result<TransportAddr, AddrParseError> {
        self.parse()
    }
}

impl ToTransportAddr for String {
    fn to_transport_addr(&self) -> Result<TransportAddr, AddrParseError> {
        self.parse()
    }
}

impl<T: ToTransportAddr + ?Sized> ToTransportAddr for &T {
    fn to_transport_addr(&self) -> Result<TransportAddr, AddrParseError> {
        (**self).to_transport_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_scheme() {
        let a: TransportAddr = "tcp://127.0.0.1:80".parse().unwrap();
        assert_eq!(a, TransportAddr::new(Transport::Tcp, "127.0.0.1", 80));
        let a: TransportAddr = "RDMA://host.example:7471/".parse().unwrap();
        assert_eq!(a, TransportAddr::new(Transport::Rdma, "host.example", 7471));
        let a: TransportAddr = "auto://[::1]:0".parse().unwrap();
        assert_eq!(a.transport(), Transport::Auto);
        assert_eq!(a.host(), "::1");
        assert_eq!(a.port(), 0);
        assert_eq!(a.to_string(), "auto://[::1]:0");
        assert_eq!(a.host_port(), ("::1", 0));
    }

    #[test]
    fn rejects_bad_addresses_with_typed_errors() {
        let err = |s: &str| s.parse::<TransportAddr>().unwrap_err();
        assert!(
            matches!(err("udp://1.2.3.4:5"), AddrParseError::UnknownScheme { scheme, .. } if scheme == "udp")
        );
        assert!(matches!(
            err("http://1.2.3.4:5"),
            AddrParseError::UnknownScheme { .. }
        ));
        assert!(matches!(
            err("1.2.3.4:5"),
            AddrParseError::MissingScheme { .. }
        ));
        assert!(matches!(
            err("rdma://1.2.3.4"),
            AddrParseError::MissingPort { .. }
        ));
        assert!(matches!(
            err("rdma://1.2.3.4:5/x"),
            AddrParseError::UnexpectedPart { .. }
        ));
        assert!(matches!(
            err("rdma://1.2.3.4:5?q"),
            AddrParseError::UnexpectedPart { .. }
        ));
        assert!(matches!(
            err("rdma://u@1.2.3.4:5"),
            AddrParseError::UnexpectedPart { .. }
        ));
        assert!(matches!(
            err("rdma://1.2.3.4:99999"),
            AddrParseError::InvalidUri { .. } | AddrParseError::MissingPort { .. }
        ));
        assert!(matches!(
            err("rdma:// bad:1"),
            AddrParseError::InvalidUri { .. }
        ));
        let io: io::Error = err("tcp://h").into();
        assert_eq!(io.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(
            io.to_string(),
            "transport address \"tcp://h\" has no port (a number in 0..=65535)"
        );
    }

    #[test]
    fn scheme_round_trip() {
        for t in [Transport::Tcp, Transport::Rdma, Transport::Auto] {
            assert_eq!(Transport::from_scheme(t.scheme()), Some(t));
        }
        assert_eq!(Transport::from_scheme("http"), None);
    }
}
