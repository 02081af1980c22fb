//! The transport-agnostic suite of the transport switch: every function
//! takes a base address (`tcp://127.0.0.1:0` on the host,
//! `rdma://10.11.0.1:0` in the Soft-RoCE guest) and checks one integration
//! over whatever transport that names, with exact values (bytes equal,
//! counts equal, transport equal).
//!
//! Run by `tests/transport_tcp.rs` (TCP, on the host) and
//! `tests/guest_transport.rs` (RDMA, in the guest).
#![allow(dead_code)]

pub mod greeter;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rdma::RdmaConfig;
use tokio_rdma::transport::{
    ConnectionInfo, Connector, Listener, Stream, Transport, TransportAddr,
};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use greeter::{GreeterClient, GreeterServer};

/// How much traffic the HTTP and framing checks send.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    /// Requests sent one after the other on the pooled client.
    pub sequential: usize,
    /// Requests in flight at once on the pooled client.
    pub concurrent: usize,
    /// Request `i` carries a 1 MiB body when `i % big_every == big_every - 1`,
    /// otherwise 0 B (even `i`) or 64 B (odd `i`). 3 cycles through the
    /// sizes evenly.
    pub big_every: usize,
    /// Frames echoed through `Framed<_, LengthDelimitedCodec>`.
    pub frames: usize,
}

/// The full sizes of the issue: 1000 sequential and 100 concurrent requests
/// with bodies of 0 B, 64 B and 1 MiB in equal shares.
pub const FULL: Scale = Scale {
    sequential: 1000,
    concurrent: 100,
    big_every: 3,
    frames: 1000,
};

/// 1 MiB.
pub const BIG: usize = 1 << 20;

/// Body size of request `i` at `scale`: 0 B, 64 B or 1 MiB.
pub fn body_size(scale: &Scale, i: usize) -> usize {
    if i % scale.big_every == scale.big_every - 1 {
        BIG
    } else if i % 2 == 0 {
        0
    } else {
        64
    }
}

/// `len` pseudo-random bytes that depend on `seed` (xorshift32).
pub fn payload(seed: usize, len: usize) -> Bytes {
    let mut x = (seed as u32).wrapping_mul(2_654_435_761) | 1;
    let mut v = vec![0u8; len];
    for chunk in v.chunks_mut(4) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    Bytes::from(v)
}

/// Binds a listener on `base` and returns it with the address clients dial
/// (same transport and host, the port actually bound).
pub async fn bind(base: &TransportAddr) -> (Listener, TransportAddr) {
    let listener = Listener::bind(base)
        .await
        .unwrap_or_else(|e| panic!("bind {base}: {e}"));
    let port = listener.local_addr().unwrap().port();
    let addr = base.clone().with_port(port);
    (listener, addr)
}

/// The transport a connection to `base` must end up on (`Auto` bases are
/// not used with the suite).
fn expected_transport(base: &TransportAddr) -> Transport {
    assert_ne!(
        base.transport(),
        Transport::Auto,
        "give the suite tcp:// or rdma://"
    );
    base.transport()
}

fn host_ip(base: &TransportAddr) -> IpAddr {
    base.host()
        .parse()
        .expect("the suite's base host is an IP address")
}

fn uri_host(addr: &TransportAddr) -> String {
    if addr.host().contains(':') {
        format!("[{}]", addr.host())
    } else {
        addr.host().to_string()
    }
}

/// HTTP version for [`hyper_pooled_client`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Http {
    /// HTTP/1.1.
    One,
    /// HTTP/2 (prior knowledge).
    Two,
}

/// A hyper echo server: every request's body comes back, with headers
/// `x-transport` and `x-peer` (the server's view of the connection).
struct EchoServer {
    addr: TransportAddr,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn spawn_echo_server(base: &TransportAddr, http: Http) -> EchoServer {
    let (listener, addr) = bind(base).await;
    let connections = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let (c, r) = (connections.clone(), requests.clone());
    let task = tokio::spawn(async move {
        loop {
            let (stream, peer) = listener.accept().await.expect("accept");
            stream.set_nodelay(true).unwrap();
            c.fetch_add(1, Ordering::SeqCst);
            let transport = stream.transport();
            let r = r.clone();
            let svc =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let r = r.clone();
                    async move {
                        let body = req.into_body().collect().await?.to_bytes();
                        r.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, hyper::Error>(
                            http::Response::builder()
                                .header("x-transport", transport.to_string())
                                .header("x-peer", peer.to_string())
                                .body(Full::new(body))
                                .unwrap(),
                        )
                    }
                });
            tokio::spawn(async move {
                let io = TokioIo::new(stream);
                let res = match http {
                    Http::One => {
                        hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, svc)
                            .await
                    }
                    Http::Two => {
                        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, svc)
                            .await
                    }
                };
                if let Err(e) = res {
                    panic!("server connection from {peer}: {e}");
                }
            });
        }
    });
    EchoServer {
        addr,
        connections,
        requests,
        task,
    }
}

/// Sends request `i` and checks the echo, the transport and the connection
/// info the connector attached.
async fn echo_request(
    client: &Client<Connector, Full<Bytes>>,
    uri: &str,
    scale: &Scale,
    i: usize,
    transport: Transport,
    server: SocketAddr,
    http: Http,
) {
    let body = payload(i, body_size(scale, i));
    let req = http::Request::post(uri)
        .body(Full::new(body.clone()))
        .unwrap();
    let res = client
        .request(req)
        .await
        .unwrap_or_else(|e| panic!("request {i}: {e:?}"));
    assert_eq!(res.status(), http::StatusCode::OK, "request {i}");
    let want_version = match http {
        Http::One => http::Version::HTTP_11,
        Http::Two => http::Version::HTTP_2,
    };
    assert_eq!(res.version(), want_version, "request {i}");
    assert_eq!(
        res.headers()["x-transport"].to_str().unwrap(),
        transport.to_string(),
        "request {i}"
    );
    let info = *res
        .extensions()
        .get::<ConnectionInfo>()
        .expect("Connected::extra carries ConnectionInfo");
    assert_eq!(info.transport, transport, "request {i}");
    assert_eq!(info.peer, server, "request {i}");
    assert_eq!(
        res.headers()["x-peer"].to_str().unwrap(),
        info.local.to_string(),
        "request {i}: the server's peer is the client's local address"
    );
    let got = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(got.len(), body.len(), "request {i}: body length");
    assert!(got == body, "request {i}: {} body bytes differ", body.len());
}

/// hyper_util's pooled client over the [`Connector`], against a hyper
/// server on a [`Listener`]: `scale.sequential` requests one after the
/// other, then `scale.concurrent` at once, bodies echoed and compared;
/// the server counts exactly `sequential + concurrent` requests. Over HTTP/2
/// every request shares exactly one connection; over HTTP/1.1 sequential
/// requests reuse pooled connections (at most 1 + sequential/50 opened).
pub async fn hyper_pooled_client(base: &TransportAddr, http: Http, scale: Scale) {
    let transport = expected_transport(base);
    let server = spawn_echo_server(base, http).await;
    let server_addr: SocketAddr = (host_ip(base), server.addr.port()).into();
    let mut connector = Connector::new(transport);
    connector.set_nodelay(true);
    let client: Client<Connector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(http == Http::Two)
        .build(connector);
    let uri = format!(
        "http://{}:{}/echo",
        uri_host(&server.addr),
        server.addr.port()
    );

    for i in 0..scale.sequential {
        echo_request(&client, &uri, &scale, i, transport, server_addr, http).await;
    }
    // Pooling works: HTTP/2 shares exactly one connection. hyper_util's
    // HTTP/1.1 pool races a checkout against a new connect, and the checkout
    // loses when the previous connection is not back in the pool yet (seen:
    // 3 connections for 1000 requests over TCP), so HTTP/1.1 gets a bound.
    let conns = server.connections.load(Ordering::SeqCst);
    match http {
        Http::Two => assert_eq!(conns, 1, "sequential HTTP/2 requests share one connection"),
        Http::One => assert!(
            (1..=1 + scale.sequential / 50).contains(&conns),
            "{conns} connections for {} sequential requests: the pool is not reused",
            scale.sequential
        ),
    }
    assert_eq!(server.requests.load(Ordering::SeqCst), scale.sequential);

    let tasks: Vec<_> = (0..scale.concurrent)
        .map(|k| {
            let client = client.clone();
            let uri = uri.clone();
            tokio::spawn(async move {
                let i = scale.sequential + k;
                echo_request(&client, &uri, &scale, i, transport, server_addr, http).await;
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("concurrent request task");
    }
    assert_eq!(
        server.requests.load(Ordering::SeqCst),
        scale.sequential + scale.concurrent
    );
    let conns = server.connections.load(Ordering::SeqCst);
    match http {
        Http::Two => assert_eq!(
            conns, 1,
            "HTTP/2 multiplexes every request on one connection"
        ),
        Http::One => assert!(
            (1..=1 + scale.concurrent).contains(&conns),
            "HTTP/1.1 opened {conns} connections for {} concurrent requests",
            scale.concurrent
        ),
    }
}

/// The URI scheme chooses the transport: a connector configured for
/// `configured` dials `{base scheme}://host:port/` over the base's
/// transport.
pub async fn hyper_scheme_selects_transport(base: &TransportAddr, configured: Transport) {
    let transport = expected_transport(base);
    let server = spawn_echo_server(base, Http::One).await;
    let client: Client<Connector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(Connector::new(configured));
    let uri = format!(
        "{}://{}:{}/x",
        transport.scheme(),
        uri_host(&server.addr),
        server.addr.port()
    );
    let res = client
        .request(
            http::Request::post(&uri)
                .body(Full::new(Bytes::from_static(b"scheme")))
                .unwrap(),
        )
        .await
        .unwrap_or_else(|e| panic!("{uri}: {e:?}"));
    assert_eq!(res.status(), http::StatusCode::OK);
    assert_eq!(
        res.extensions().get::<ConnectionInfo>().unwrap().transport,
        transport
    );
    assert_eq!(
        res.into_body().collect().await.unwrap().to_bytes(),
        &b"scheme"[..]
    );
}

/// An axum app served on a [`Listener`] with
/// `into_make_service_with_connect_info::<ConnectionInfo>()`: the handler
/// sees the client's exact address, the server address and the transport.
pub async fn axum_connect_info(base: &TransportAddr) {
    use axum::Router;
    use axum::extract::ConnectInfo;
    use axum::routing::get;

    let transport = expected_transport(base);
    let (listener, addr) = bind(base).await;
    let app = Router::new().route(
        "/who",
        get(
            |ConnectInfo(info): ConnectInfo<ConnectionInfo>| async move {
                format!("{} {} {}", info.peer, info.transport, info.local)
            },
        ),
    );
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<ConnectionInfo>(),
        )
        .await
        .unwrap();
    });

    for round in 0..3 {
        let stream = Stream::connect(&addr).await.unwrap();
        assert_eq!(stream.transport(), transport);
        let local = stream.local_addr().unwrap();
        let remote = stream.peer_addr().unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        let conn = tokio::spawn(conn);
        let req = http::Request::get("/who")
            .header(http::header::HOST, "suite")
            .body(Empty::<Bytes>::new())
            .unwrap();
        let res = sender.send_request(req).await.unwrap();
        assert_eq!(res.status(), http::StatusCode::OK, "round {round}");
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            format!("{local} {transport} {remote}"),
            "round {round}"
        );
        drop(sender);
        conn.await.unwrap().unwrap();
    }
    server.abort();
}

/// tonic over a [`Listener`] (`serve_with_incoming`) and a channel through
/// the [`Connector`]: unary, server-streaming and bidirectional-streaming
/// RPCs of the hand-written greeter.
pub async fn tonic_rpcs(base: &TransportAddr, messages: u32) {
    let transport = expected_transport(base);
    let (listener, addr) = bind(base).await;
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(GreeterServer)
            .serve_with_incoming(listener.into_incoming()),
    );
    // The client side learns its transport from the connector it gave tonic.
    let connector = Connector::new(addr.transport());
    assert_eq!(connector.last_connection(), None);
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}:{}", addr.host(), addr.port()))
            .unwrap()
            .connect_with_connector(connector.clone())
            .await
            .unwrap();
    let info = connector.last_connection().expect("the channel connected");
    assert_eq!(info.transport, transport);
    assert_eq!(info.peer.port(), addr.port());
    assert_eq!(info.peer.ip(), host_ip(base));
    let mut client = GreeterClient::new(channel);

    // Unary: the server saw this transport and our IP.
    for name in ["world", "", "rdma"] {
        assert_eq!(
            client.say_hello(name).await.unwrap(),
            format!("Hello, {name} over {transport} from {}", host_ip(base))
        );
    }

    // Server streaming.
    let got: Vec<Bytes> = client
        .count(messages)
        .await
        .unwrap()
        .map(|m| m.unwrap())
        .collect()
        .await;
    let want: Vec<Bytes> = (0..messages).map(|i| Bytes::from(i.to_string())).collect();
    assert_eq!(got, want);

    // Bidirectional streaming, sizes 0 B .. ~64 KiB.
    let sent: Vec<Bytes> = (0..messages as usize)
        .map(|i| payload(i, (i * 7919) % 65_000))
        .collect();
    let echoed: Vec<Bytes> = client
        .echo(futures::stream::iter(sent.clone()))
        .await
        .unwrap()
        .map(|m| m.unwrap())
        .collect()
        .await;
    assert_eq!(echoed.len(), sent.len());
    assert!(echoed == sent, "echoed messages differ");

    // A second client channel works alongside.
    let mut second = GreeterClient::new(
        tokio_rdma::transport::channel_with(addr.to_string(), &RdmaConfig::default())
            .await
            .unwrap(),
    );
    assert_eq!(
        second.say_hello("again").await.unwrap(),
        format!("Hello, again over {transport} from {}", host_ip(base))
    );
    server.abort();
}

fn tls_configs() -> (
    Arc<tokio_rustls::rustls::ServerConfig>,
    Arc<tokio_rustls::rustls::ClientConfig>,
) {
    use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig, crypto};

    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
    let provider = Arc::new(crypto::ring::default_provider());
    let server = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    let mut roots = RootCertStore::empty();
    roots.add(cert).unwrap();
    let client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    (Arc::new(server), Arc::new(client))
}

/// TLS (tokio-rustls, self-signed rcgen certificate) over the stream: the
/// client sends `up` bytes and half-closes (close_notify + FIN); the server
/// reads exactly those bytes to EOF, then answers `down` bytes and closes
/// the same way; the client reads them to EOF.
pub async fn tls_half_close(base: &TransportAddr, up: usize, down: usize) {
    let transport = expected_transport(base);
    let (server_cfg, client_cfg) = tls_configs();
    let (listener, addr) = bind(base).await;
    let up_data = payload(1, up);
    let down_data = payload(2, down);

    let (u, d) = (up_data.clone(), down_data.clone());
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        assert_eq!(stream.transport(), transport);
        let mut tls = tokio_rustls::TlsAcceptor::from(server_cfg)
            .accept(stream)
            .await
            .unwrap();
        let mut got = Vec::new();
        tls.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), u.len());
        assert!(got == u, "server: received bytes differ");
        let (_, conn) = tls.get_ref();
        assert!(conn.alpn_protocol().is_none());
        tls.write_all(&d).await.unwrap();
        tls.shutdown().await.unwrap();
    });

    let stream = Stream::connect(&addr).await.unwrap();
    assert_eq!(stream.transport(), transport);
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(client_cfg)
        .connect(name, stream)
        .await
        .unwrap();
    tls.write_all(&up_data).await.unwrap();
    tls.shutdown().await.unwrap();
    let mut got = Vec::new();
    tls.read_to_end(&mut got).await.unwrap();
    assert_eq!(got.len(), down_data.len());
    assert!(got == down_data, "client: received bytes differ");
    server.await.unwrap();
}

/// `Framed` + `LengthDelimitedCodec` both ends: `frames` frames of 0 B to
/// ~64 KiB echoed by the server, all received in order; closing the sink
/// ends both streams.
pub async fn framed_length_delimited(base: &TransportAddr, frames: usize) {
    let transport = expected_transport(base);
    let (listener, addr) = bind(base).await;
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        assert_eq!(stream.transport(), transport);
        let mut framed = Framed::new(stream, LengthDelimitedCodec::new());
        let mut n = 0usize;
        while let Some(frame) = framed.next().await {
            framed.send(frame.unwrap().freeze()).await.unwrap();
            n += 1;
        }
        SinkExt::<Bytes>::close(&mut framed).await.unwrap();
        n
    });

    let stream = Stream::connect(&addr).await.unwrap();
    let (mut sink, mut source) = Framed::new(stream, LengthDelimitedCodec::new()).split();
    let sent: Vec<Bytes> = (0..frames)
        .map(|i| payload(i, (i * 6151) % 65_537))
        .collect();
    let to_send = sent.clone();
    let writer = tokio::spawn(async move {
        for f in to_send {
            sink.send(f).await.unwrap();
        }
        sink.close().await.unwrap();
    });
    let mut received = 0usize;
    while let Some(frame) = source.next().await {
        let frame = frame.unwrap();
        assert!(received < frames, "more frames than sent");
        assert_eq!(frame.len(), sent[received].len(), "frame {received}");
        assert!(frame == sent[received], "frame {received} differs");
        received += 1;
    }
    writer.await.unwrap();
    assert_eq!(received, frames);
    assert_eq!(server.await.unwrap(), frames);
}

/// `auto://` against a TCP-only peer (a plain `tokio::net::TcpListener` on
/// `host`): falls back to TCP and exchanges bytes. `mpa_probes` is how many
/// connections the peer sees first that start with MPA's request key
/// (`"MPA ID Req Frame"`, RFC 5044 7.1): 1 over iWARP, whose RDMA attempt
/// is a TCP connection to the same port, 0 otherwise.
pub async fn auto_falls_back_to_tcp_peer(host: &str, mpa_probes: usize) {
    const MPA_REQ_KEY: &[u8; 16] = b"MPA ID Req Frame";
    let tcp = tokio::net::TcpListener::bind((host, 0)).await.unwrap();
    let server_addr = tcp.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut probes = 0;
        loop {
            let (mut s, _) = tcp.accept().await.unwrap();
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf).await.unwrap();
            if &buf == b"hello" {
                s.write_all(b"world").await.unwrap();
                return probes;
            }
            let mut key = [0u8; 16];
            key[..5].copy_from_slice(&buf);
            s.read_exact(&mut key[5..]).await.unwrap();
            assert_eq!(&key, MPA_REQ_KEY, "a connection that is neither");
            probes += 1;
        }
    });
    let addr = TransportAddr::new(Transport::Auto, host, server_addr.port());
    let mut s = Stream::connect(&addr).await.unwrap();
    assert_eq!(s.transport(), Transport::Tcp);
    assert_eq!(s.peer_addr().unwrap(), server_addr);
    s.write_all(b"hello").await.unwrap();
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"world");
    assert_eq!(server.await.unwrap(), mpa_probes, "MPA requests seen");
}

/// One round trip of `msg` through a connection to an accepting
/// [`Listener`]; returns the transports of both ends.
pub async fn round_trip(
    listener: &Listener,
    addr: &TransportAddr,
    msg: &[u8],
) -> (Transport, Transport) {
    let connect = async {
        let mut s = Stream::connect(addr).await.unwrap();
        s.write_all(msg).await.unwrap();
        s.shutdown().await.unwrap();
        let mut back = Vec::new();
        s.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, msg);
        s.transport()
    };
    let accept = async {
        let (mut s, peer) = listener.accept().await.unwrap();
        assert_eq!(s.peer_addr().unwrap(), peer);
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        s.write_all(&got).await.unwrap();
        s.shutdown().await.unwrap();
        s.transport()
    };
    let (c, a) = tokio::join!(connect, accept);
    (c, a)
}

/// Wraps a suite future with a deadline so a hang fails instead of blocking
/// the run.
pub async fn within<F: std::future::Future>(limit: Duration, what: &str, f: F) -> F::Output {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}
