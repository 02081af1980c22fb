//! Requests per second and p50/p99 latency of HTTP/1.1 and gRPC over RDMA
//! and over TCP on the same interface, measured in one run and printed side
//! by side. Run it inside the Soft-RoCE guest with `integration/bench-http`,
//! or directly on a host with an RDMA NIC:
//!
//! ```text
//! cargo run --release --features hyper,axum,tonic --example http_perf -- --addr 192.0.2.10
//! ```
//!
//! Workloads, each run once over `tcp://` and once over `rdma://`:
//! - HTTP/1.1 `POST` echo with a 64 B body and with an 8 KiB body: hyper's
//!   server on a [`Listener`], hyper_util's pooled client with the
//!   [`Connector`];
//! - gRPC unary: the hand-written greeter of
//!   `tests/transport_suite/greeter.rs` (`SayHello` with a 64 B name) served
//!   by tonic on [`Listener::into_incoming`], called over a tonic channel
//!   through the [`Connector`].
//!
//! Server and client run in this process on `--addr` (port 0). Each
//! measurement starts with `--warmup` requests that are not counted, then
//! times `--requests` requests issued by `--concurrency` tasks (default 1:
//! sequential requests, so HTTP/1.1 uses one keep-alive connection; with
//! C > 1 the HTTP/1.1 pool opens up to C connections and gRPC multiplexes C
//! calls on its one HTTP/2 connection). Every answer is checked byte for
//! byte (each request carries its sequence number, so a stale or misrouted
//! answer is caught as well) and on the transport it was meant to use; a
//! wrong answer stops that measurement and makes the exit status 1. TCP
//! connections have `TCP_NODELAY` on both sides, as tonic's own connector
//! sets it. Nothing here asserts a speed: this is a benchmark.

#[path = "../tests/transport_suite/greeter.rs"]
mod greeter;

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use futures::StreamExt;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio_rdma::transport::{ConnectionInfo, Connector, Listener, Transport, TransportAddr};
use tonic::transport::Endpoint;

use greeter::{GreeterClient, GreeterServer};

#[derive(Parser, Debug)]
#[command(about = "HTTP/1.1 and gRPC over RDMA vs TCP: requests/s and latency, side by side")]
struct Args {
    /// IP address of the RDMA interface (servers and clients run here).
    #[arg(long, default_value = "10.11.0.1")]
    addr: IpAddr,
    /// Timed requests per workload and transport.
    #[arg(long, default_value_t = 2000)]
    requests: u64,
    /// Requests before each timed run, not counted.
    #[arg(long, default_value_t = 100)]
    warmup: u64,
    /// Tasks issuing requests at once (1: sequential on one connection).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Measure TCP only (on a host without an RDMA device).
    #[arg(long)]
    tcp_only: bool,
}

/// The longest one request may take before the measurement is abandoned.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// One request in flight: `Ok` when the answer was verified.
type CallFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// Issues one request, numbered by its argument.
type Call = Arc<dyn Fn(u64) -> CallFuture + Send + Sync>;

/// The outcome of one timed run.
struct Stats {
    /// Requests timed.
    requests: u64,
    /// Wall time from the first request to the last answer.
    elapsed: Duration,
    /// Per-request latency in nanoseconds.
    hist: Histogram<u64>,
}

impl Stats {
    /// Requests per second over the whole run.
    fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    /// The latency at quantile `q`, in microseconds.
    fn us(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
}

/// The workloads, in the order of the table.
#[derive(Debug, Clone, Copy)]
enum Workload {
    /// HTTP/1.1 POST echo with a body of this many bytes.
    Http1(usize),
    /// gRPC unary `SayHello`.
    GrpcUnary,
}

impl Workload {
    /// The row label.
    fn label(self) -> String {
        match self {
            Workload::Http1(64) => "HTTP/1.1 POST 64 B".into(),
            Workload::Http1(8192) => "HTTP/1.1 POST 8 KiB".into(),
            Workload::Http1(n) => format!("HTTP/1.1 POST {n} B"),
            Workload::GrpcUnary => "gRPC unary 64 B".into(),
        }
    }
}

/// Bytes in the name sent to `SayHello`.
const GRPC_NAME_LEN: usize = 64;

/// The body (or name) of request `seq`: its sequence number in hex, then a
/// fixed pattern, `len` bytes in all (`len` >= 16).
fn payload(seq: u64, len: usize) -> Vec<u8> {
    let mut v = format!("{seq:016x}").into_bytes();
    v.extend((16..len).map(|i| b'a' + (i % 26) as u8));
    v.truncate(len);
    v
}

/// Runs `count` requests with `concurrency` tasks (numbers from `first`);
/// returns the latency histogram and the wall time.
async fn drive(
    call: &Call,
    first: u64,
    count: u64,
    concurrency: usize,
) -> Result<(Histogram<u64>, Duration), String> {
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency.max(1))
        .map(|_| {
            let call = call.clone();
            let next = next.clone();
            tokio::spawn(async move {
                let mut h = Histogram::<u64>::new(3).expect("histogram");
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        return Ok(h);
                    }
                    let t = Instant::now();
                    match tokio::time::timeout(REQUEST_TIMEOUT, call(first + i)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Err(format!("request {}: {e}", first + i)),
                        Err(_) => {
                            return Err(format!(
                                "request {}: no answer in {REQUEST_TIMEOUT:?}",
                                first + i
                            ));
                        }
                    }
                    h.record(t.elapsed().as_nanos() as u64)
                        .map_err(|e| e.to_string())?;
                }
            })
        })
        .collect();
    let mut hist = Histogram::<u64>::new(3).expect("histogram");
    let mut failure = None;
    for t in tasks {
        match t.await {
            Ok(Ok(h)) => hist.add(h).map_err(|e| e.to_string())?,
            Ok(Err(e)) => failure = failure.or(Some(e)),
            Err(e) => failure = failure.or(Some(format!("task: {e}"))),
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok((hist, start.elapsed())),
    }
}

/// Warm-up, then the timed run.
async fn measure(call: Call, args: &Args) -> Result<Stats, String> {
    drive(&call, 0, args.warmup, args.concurrency).await?;
    let (hist, elapsed) = drive(&call, args.warmup, args.requests, args.concurrency).await?;
    Ok(Stats {
        requests: args.requests,
        elapsed,
        hist,
    })
}

/// Binds `transport://addr:0`; returns the listener and its port.
async fn bind(addr: IpAddr, transport: Transport) -> Result<(Listener, u16), String> {
    let listener = Listener::bind(TransportAddr::new(transport, addr.to_string(), 0))
        .await
        .map_err(|e| format!("bind {transport}://{addr}:0: {e}"))?;
    let port = listener
        .local_addr()
        .map_err(|e| format!("local_addr: {e}"))?
        .port();
    Ok((listener, port))
}

/// The HTTP/1.1 server: echoes every body.
async fn echo(req: http::Request<Incoming>) -> Result<http::Response<Full<Bytes>>, hyper::Error> {
    let body = req.into_body().collect().await?.to_bytes();
    Ok(http::Response::new(Full::new(body)))
}

/// Starts the HTTP/1.1 echo server; returns its port.
async fn http_server(addr: IpAddr, transport: Transport) -> Result<u16, String> {
    let (listener, port) = bind(addr, transport).await?;
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    eprintln!("http_perf: accept on {transport}: {e}");
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                if let Err(e) = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(echo))
                    .await
                {
                    eprintln!("http_perf: HTTP connection over {transport}: {e}");
                }
            });
        }
    });
    Ok(port)
}

/// A client connector for `transport`, with `TCP_NODELAY` on.
fn connector(transport: Transport) -> Connector {
    let mut c = Connector::new(transport);
    c.set_nodelay(true);
    c
}

/// HTTP/1.1 POST echo of `size` bytes to `server`, verified byte for byte.
fn http_call(transport: Transport, server: SocketAddr, size: usize) -> Call {
    let client: Client<Connector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector(transport));
    let uri: http::Uri = format!("http://{server}/echo").parse().expect("valid URI");
    Arc::new(move |seq| {
        let client = client.clone();
        let uri = uri.clone();
        Box::pin(async move {
            let sent = Bytes::from(payload(seq, size));
            let req = http::Request::post(uri)
                .body(Full::new(sent.clone()))
                .map_err(|e| e.to_string())?;
            let res = client.request(req).await.map_err(|e| format!("{e:?}"))?;
            if res.status() != http::StatusCode::OK {
                return Err(format!("status {}", res.status()));
            }
            match res.extensions().get::<ConnectionInfo>() {
                Some(info) if info.transport == transport => {}
                other => return Err(format!("answer came over {other:?}, not {transport}")),
            }
            let back = res
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            if back != sent {
                return Err(format!(
                    "echo differs: {} bytes sent, {} came back",
                    sent.len(),
                    back.len()
                ));
            }
            Ok(())
        }) as CallFuture
    })
}

/// Starts the tonic greeter; returns its port.
async fn grpc_server(addr: IpAddr, transport: Transport) -> Result<u16, String> {
    let (listener, port) = bind(addr, transport).await?;
    let incoming = listener.into_incoming().map(|r| {
        r.inspect(|s| {
            let _ = s.set_nodelay(true);
        })
    });
    tokio::spawn(async move {
        if let Err(e) = tonic::transport::Server::builder()
            .add_service(GreeterServer)
            .serve_with_incoming(incoming)
            .await
        {
            eprintln!("http_perf: gRPC server over {transport}: {e}");
        }
    });
    Ok(port)
}

/// gRPC unary `SayHello` to `server`, the greeting verified exactly.
async fn grpc_call(transport: Transport, server: SocketAddr) -> Result<Call, String> {
    let channel = Endpoint::from_shared(format!("http://{server}"))
        .map_err(|e| e.to_string())?
        .connect_with_connector(connector(transport))
        .await
        .map_err(|e| format!("gRPC connect to {transport}://{server}: {e:?}"))?;
    let client = GreeterClient::new(channel);
    let ip = server.ip();
    Ok(Arc::new(move |seq| {
        let mut client = client.clone();
        Box::pin(async move {
            let name = String::from_utf8(payload(seq, GRPC_NAME_LEN)).expect("ASCII");
            let got = client.say_hello(&name).await.map_err(|e| e.to_string())?;
            // The server greets from its view of the connection; client and
            // server share `ip`.
            let want = format!("Hello, {name} over {transport} from {ip}");
            if got != want {
                return Err(format!("greeting differs: {got:?}, want {want:?}"));
            }
            Ok(())
        }) as CallFuture
    }))
}

/// Sets up `workload` over `transport` and measures it.
async fn run(workload: Workload, transport: Transport, args: &Args) -> Result<Stats, String> {
    let call = match workload {
        Workload::Http1(size) => {
            let port = http_server(args.addr, transport).await?;
            http_call(transport, SocketAddr::new(args.addr, port), size)
        }
        Workload::GrpcUnary => {
            let port = grpc_server(args.addr, transport).await?;
            grpc_call(transport, SocketAddr::new(args.addr, port)).await?
        }
    };
    measure(call, args).await
}

/// `req/s` of a result, or why there is none.
fn rps_cell(r: &Result<Stats, String>) -> String {
    match r {
        Ok(s) => format!("{:.1}", s.rps()),
        Err(_) => "FAILED".into(),
    }
}

/// `p50/p99` in microseconds of a result.
fn lat_cell(r: &Result<Stats, String>) -> String {
    match r {
        Ok(s) => format!("{:.0}/{:.0}", s.us(0.5), s.us(0.99)),
        Err(_) => "FAILED".into(),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let transports: &[Transport] = if args.tcp_only {
        &[Transport::Tcp]
    } else {
        &[Transport::Tcp, Transport::Rdma]
    };
    println!(
        "http_perf: addr {}, {} timed requests after {} warm-up, concurrency {}",
        args.addr, args.requests, args.warmup, args.concurrency
    );

    let workloads = [
        Workload::Http1(64),
        Workload::Http1(8192),
        Workload::GrpcUnary,
    ];
    let mut rows = Vec::new();
    let mut failed = false;
    for w in workloads {
        let mut results = Vec::new();
        for &t in transports {
            let r = run(w, t, &args).await;
            match &r {
                Ok(s) => println!(
                    "  {:<20} {t:<4}: {} requests in {:.2} s",
                    w.label(),
                    s.requests,
                    s.elapsed.as_secs_f64()
                ),
                Err(e) => {
                    failed = true;
                    println!("  {:<20} {t:<4}: FAILED: {e}", w.label());
                }
            }
            results.push(r);
        }
        rows.push((w, results));
    }

    println!();
    println!(
        "{:<20} {:>10} {:>10} {:>9} {:>16} {:>16}",
        "workload", "TCP req/s", "RDMA req/s", "RDMA/TCP", "TCP p50/p99 us", "RDMA p50/p99 us"
    );
    let missing: Result<Stats, String> = Err("not measured".into());
    for (w, results) in &rows {
        let tcp = &results[0];
        let rdma = results.get(1).unwrap_or(&missing);
        let ratio = match (tcp, rdma) {
            (Ok(t), Ok(r)) => format!("{:.2}", r.rps() / t.rps()),
            _ => "n/a".into(),
        };
        println!(
            "{:<20} {:>10} {:>10} {:>9} {:>16} {:>16}",
            w.label(),
            rps_cell(tcp),
            if args.tcp_only {
                "-".into()
            } else {
                rps_cell(rdma)
            },
            ratio,
            lat_cell(tcp),
            if args.tcp_only {
                "-".into()
            } else {
                lat_cell(rdma)
            },
        );
    }
    if failed {
        std::process::exit(1);
    }
}
