//! Guest tests: hyper 1.x (HTTP/1.1 and HTTP/2) over RdmaStream, server and
//! client in one process on rxe0 (10.11.0.1). Run inside the Soft-RoCE guest
//! by `integration/softroce`; without a device they fail, never skip.
//!
//! The HTTP/2 test is the flow-control deadlock check: h2 stops reading the
//! socket while its writes are blocked, so fifty 1 MiB uploads echoed back on
//! one connection hang unless the stream makes receive progress on its own.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it), so
//! host builds (`cargo test --all-features` included) leave it empty.
#![cfg(tokio_rdma_guest)]

mod common;

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rdma::{ConnectionStats, RdmaListener, RdmaStream};

#[path = "../examples/shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

/// The address of rxe0 in the guest.
const IP: &str = "10.11.0.1";
/// One mebibyte.
const MIB: usize = 1 << 20;

/// An [`RdmaStream`] shared with the test, so that a hung test can report
/// both ends' [`ConnectionStats`] while hyper owns the I/O.
#[derive(Clone)]
struct Watched(Arc<Mutex<RdmaStream>>);

impl Watched {
    /// Wraps `s` for sharing.
    fn new(s: RdmaStream) -> Self {
        Watched(Arc::new(Mutex::new(s)))
    }

    /// Runs `f` on the locked stream (polls are short, so this never waits
    /// long).
    fn with<R>(&self, f: impl FnOnce(Pin<&mut RdmaStream>) -> R) -> R {
        let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(Pin::new(&mut *s))
    }

    /// The wrapped stream's counters.
    fn stats(&self) -> ConnectionStats {
        self.with(|s| s.stats())
    }
}

/// Forwards to the wrapped stream.
impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.with(|s| s.poll_read(cx, buf))
    }
}

/// Forwards to the wrapped stream (vectored writes included).
impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.with(|s| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.with(|s| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.with(|s| s.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|s| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|s| s.poll_shutdown(cx))
    }
}

/// The response body type of every route.
type Body = BoxBody<Bytes, hyper::Error>;

/// A complete in-memory body.
fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// The routes of `examples/hyper_server.rs`.
async fn handle(req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path();
    let resp = match (req.method(), path) {
        (&Method::GET, "/hello") => Response::new(full("hello over RDMA\n")),
        (&Method::POST, "/echo") => Response::new(req.into_body().boxed()),
        (&Method::GET, p) if p.starts_with("/bytes/") => {
            let n: usize = p["/bytes/".len()..].parse().unwrap_or(0);
            Response::new(full((0..n).map(|i| (i % 251) as u8).collect::<Vec<_>>()))
        }
        _ => {
            let mut r = Response::new(full("not found\n"));
            *r.status_mut() = StatusCode::NOT_FOUND;
            r
        }
    };
    Ok(resp)
}

/// Binds on rxe0, accepts ONE connection and serves it with hyper. Returns
/// the address, the served stream (once accepted) and the serving task.
async fn serve_one(
    http2: bool,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Receiver<Watched>,
    tokio::task::JoinHandle<Result<(), hyper::Error>>,
) {
    let l = RdmaListener::bind(format!("{IP}:0"))
        .await
        .expect("bind on rxe0's address");
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let (s, _) = l.accept().await.expect("accept");
        assert_eq!(s.device(), common::device());
        let io = Watched::new(s);
        let _ = tx.send(io.clone());
        let io = TokioIo::new(io);
        if http2 {
            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(io, service_fn(handle))
                .await
        } else {
            hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service_fn(handle))
                .await
        }
    });
    (addr, rx, task)
}

/// Byte `i` of request `req`'s body (differs between requests): a
/// splitmix64 hash with no short period.
fn pattern(req: usize, i: usize) -> u8 {
    let (seed, i) = (req as u64, i as u64);
    shared::pattern_byte(seed, i)
}

/// The body of request `req`: `len` bytes of [`pattern`].
fn body_for(req: usize, len: usize) -> Bytes {
    (0..len).map(|i| pattern(req, i)).collect()
}

/// Asserts `got == sent`, naming the first differing byte (not dumping
/// megabytes).
fn assert_echo(req: usize, sent: &[u8], got: &[u8]) {
    if let Some(i) = sent.iter().zip(got).position(|(a, b)| a != b) {
        panic!(
            "request {req}: echoed byte {i} is {:#04x}, sent {:#04x}",
            got[i], sent[i]
        );
    }
    assert_eq!(got.len(), sent.len(), "request {req}: echoed length");
}

/// Awaits `fut` for at most `secs`; on timeout panics with both ends' stats.
async fn within<T>(
    secs: u64,
    what: &str,
    client: &Watched,
    server: &Watched,
    fut: impl std::future::Future<Output = T>,
) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!(
            "{what}: no result after {secs} s\nclient stats: {:?}\nserver stats: {:?}",
            client.stats(),
            server.stats()
        ),
    }
}

/// Collects a whole response.
async fn collect(resp: Response<Incoming>) -> (StatusCode, Bytes) {
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("response body")
        .to_bytes();
    (status, body)
}

/// HTTP/2, hyper's default windows: 50 requests at once on one connection,
/// each uploading 1 MiB and downloading its 1 MiB echo, every byte checked;
/// then a clean close on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_fifty_concurrent_1mib_echoes_on_one_connection() {
    const REQUESTS: usize = 50;
    let (addr, served, server) = serve_one(true).await;
    let s = RdmaStream::connect(addr).await.expect("connect");
    assert_eq!(s.device(), common::device());
    let client_io = Watched::new(s);
    let server_io = served.await.expect("server accepted");
    let (sender, conn) = hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        TokioIo::new(client_io.clone()),
    )
    .await
    .expect("HTTP/2 handshake");
    let conn = tokio::spawn(conn);

    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let mut sender = sender.clone();
            tokio::spawn(async move {
                let body = body_for(i, MIB);
                let req = Request::post(format!("http://{addr}/echo"))
                    .body(Full::new(body.clone()))
                    .unwrap();
                let resp = sender.send_request(req).await.expect("send_request");
                let (status, got) = collect(resp).await;
                assert_eq!(status, StatusCode::OK, "request {i}");
                assert_echo(i, &body, &got);
                got.len()
            })
        })
        .collect();
    let lens = within(
        400,
        "50 concurrent HTTP/2 echoes",
        &client_io,
        &server_io,
        async {
            let mut lens = Vec::new();
            for t in tasks {
                lens.push(t.await.expect("request task"));
            }
            lens
        },
    )
    .await;
    assert_eq!(lens, vec![MIB; REQUESTS]);

    let st = client_io.stats();
    eprintln!(
        "client stats: {st:?}\nserver stats: {:?}",
        server_io.stats()
    );
    assert!(
        st.bytes_sent >= (REQUESTS * MIB) as u64 && st.bytes_received >= (REQUESTS * MIB) as u64,
        "client stats {st:?}"
    );
    assert_eq!(st.errors, 0, "client stats {st:?}");

    // Closing the client ends the connection cleanly on both sides.
    drop(sender);
    within(60, "HTTP/2 client close", &client_io, &server_io, conn)
        .await
        .expect("client connection task")
        .expect("client connection");
    within(60, "HTTP/2 server close", &client_io, &server_io, server)
        .await
        .expect("server task")
        .expect("server connection");
    assert_eq!(server_io.stats().errors, 0);
}

/// HTTP/1.1: 100 sequential echoes of 0 B, 64 B and 1 MiB (in turn), every
/// byte checked; `GET /hello` and `GET /bytes/65536` exact; a clean close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_hundred_sequential_echoes_and_hello() {
    const REQUESTS: usize = 100;
    const SIZES: [usize; 3] = [0, 64, MIB];
    let (addr, served, server) = serve_one(false).await;
    let s = RdmaStream::connect(addr).await.expect("connect");
    assert_eq!(s.device(), common::device());
    let client_io = Watched::new(s);
    let server_io = served.await.expect("server accepted");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(client_io.clone()))
        .await
        .expect("HTTP/1.1 handshake");
    let conn = tokio::spawn(conn);
    let host = addr.to_string();

    let mut total = 0usize;
    within(
        400,
        "100 sequential HTTP/1.1 echoes",
        &client_io,
        &server_io,
        async {
            for i in 0..REQUESTS {
                let body = body_for(i, SIZES[i % SIZES.len()]);
                let req = Request::post("/echo")
                    .header(hyper::header::HOST, &host)
                    .body(Full::new(body.clone()))
                    .unwrap();
                sender.ready().await.expect("connection ready");
                let resp = sender.send_request(req).await.expect("send_request");
                let (status, got) = collect(resp).await;
                assert_eq!(status, StatusCode::OK, "request {i}");
                assert_echo(i, &body, &got);
                total += got.len();
            }
        },
    )
    .await;
    // In cycle order 0 B, 64 B, 1 MiB: 34 x 0 B + 33 x 64 B + 33 x 1 MiB.
    let want: usize = (0..REQUESTS).map(|i| SIZES[i % SIZES.len()]).sum();
    assert_eq!(total, want);
    assert_eq!(want, 33 * MIB + 33 * 64);

    let get = |path: &str| {
        Request::get(path)
            .header(hyper::header::HOST, &host)
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let (status, hello) = within(60, "GET /hello", &client_io, &server_io, async {
        sender.ready().await.expect("connection ready");
        collect(
            sender
                .send_request(get("/hello"))
                .await
                .expect("GET /hello"),
        )
        .await
    })
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(&hello[..], b"hello over RDMA\n");

    let (status, bytes) = within(60, "GET /bytes/65536", &client_io, &server_io, async {
        sender.ready().await.expect("connection ready");
        collect(
            sender
                .send_request(get("/bytes/65536"))
                .await
                .expect("GET /bytes"),
        )
        .await
    })
    .await;
    assert_eq!(status, StatusCode::OK);
    let want: Vec<u8> = (0..65536usize).map(|i| (i % 251) as u8).collect();
    assert_echo(0, &want, &bytes);

    let st = client_io.stats();
    eprintln!(
        "client stats: {st:?}\nserver stats: {:?}",
        server_io.stats()
    );
    assert_eq!(st.errors, 0, "client stats {st:?}");
    drop(sender);
    within(60, "HTTP/1.1 client close", &client_io, &server_io, conn)
        .await
        .expect("client connection task")
        .expect("client connection");
    within(60, "HTTP/1.1 server close", &client_io, &server_io, server)
        .await
        .expect("server task")
        .expect("server connection");
    assert_eq!(server_io.stats().errors, 0);
}
