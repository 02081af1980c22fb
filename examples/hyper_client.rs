//! An HTTP client on hyper 1.x over ONE [`RdmaStream`], for `hyper_server`.
//!
//! ```text
//! hyper_client 10.11.0.1:8080 --requests 1000 --body-bytes 4096
//! hyper_client 10.11.0.1:8080 --http2 --requests 1000 --concurrency 50 --body-bytes 1048576
//! ```
//!
//! Opens one connection, runs N `POST /echo` requests with B-byte bodies
//! (C at once with `--http2`; one after another with HTTP/1.1), checks every
//! echoed byte, then `GET /hello` once and prints it. The last line is
//! `hyper_client: N requests in S s, R req/s, PROTOCOL, device DEV, verified`.
//! Exits non-zero on any error or mismatch.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio_rdma::RdmaStream;

#[path = "shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

/// Command line.
#[derive(Parser)]
#[command(about = "HTTP client (hyper) over one RDMA stream")]
struct Args {
    /// Server address, for example `10.11.0.1:8080` (an `http://` prefix is
    /// accepted).
    addr: String,
    /// Speak HTTP/2 (prior knowledge) instead of HTTP/1.1.
    #[arg(long)]
    http2: bool,
    /// Number of `POST /echo` requests.
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Requests in flight at once (HTTP/2 only; HTTP/1.1 runs one at a time).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Bytes in each request body.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
}

/// Byte `i` of request `req`'s body: differs between requests, so a body
/// delivered to the wrong request is caught.
fn pattern(req: usize, i: usize) -> u8 {
    let (seed, i) = (req as u64, i as u64);
    shared::pattern_byte(seed, i)
}

/// The body of request `req`.
fn body_for(req: usize, len: usize) -> Bytes {
    (0..len).map(|i| pattern(req, i)).collect()
}

/// Checks an echo against the body sent; the error names the first
/// difference.
fn verify(req: usize, sent: &[u8], got: &[u8]) -> Result<(), String> {
    if let Some(i) = sent.iter().zip(got).position(|(a, b)| a != b) {
        return Err(format!(
            "request {req}: echoed byte {i} is {:#04x}, sent {:#04x}",
            got[i], sent[i]
        ));
    }
    if sent.len() != got.len() {
        return Err(format!(
            "request {req}: echoed {} bytes, sent {}",
            got.len(),
            sent.len()
        ));
    }
    Ok(())
}

/// One side of a client connection, either protocol.
#[derive(Clone)]
enum Sender {
    /// HTTP/1.1: one request at a time.
    Http1(Arc<tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Full<Bytes>>>>),
    /// HTTP/2: cloned per concurrent request.
    Http2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Sender {
    /// Sends `req` and collects the whole response.
    async fn send(&self, req: Request<Full<Bytes>>) -> Result<(StatusCode, Bytes), String> {
        let resp = match self {
            Sender::Http1(s) => {
                let mut s = s.lock().await;
                s.ready().await.map_err(|e| format!("connection: {e}"))?;
                s.send_request(req).await
            }
            Sender::Http2(s) => {
                let mut s = s.clone();
                s.ready().await.map_err(|e| format!("connection: {e}"))?;
                s.send_request(req).await
            }
        }
        .map_err(|e| format!("request: {e}"))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("response body: {e}"))?
            .to_bytes();
        Ok((status, body))
    }
}

/// Builds a request for `path` on `authority`.
fn request(
    http2: bool,
    authority: &str,
    method: Method,
    path: &str,
    body: Bytes,
) -> Request<Full<Bytes>> {
    // HTTP/2 needs :scheme and :authority, so an absolute URI; HTTP/1.1
    // uses the origin form and a Host header.
    let b = if http2 {
        Request::builder().uri(format!("http://{authority}{path}"))
    } else {
        Request::builder()
            .uri(path)
            .header(hyper::header::HOST, authority)
    };
    b.method(method)
        .body(Full::new(body))
        .expect("valid request parts")
}

/// Runs the whole client; returns the summary line.
async fn run(args: Args) -> Result<String, String> {
    if !args.http2 && args.concurrency > 1 {
        return Err(
            "--concurrency > 1 needs --http2 (HTTP/1.1 sends one request at a time)".into(),
        );
    }
    if args.concurrency == 0 {
        return Err("--concurrency must be at least 1".into());
    }
    let authority = args.addr.trim_start_matches("http://").to_string();
    let stream = RdmaStream::connect(authority.as_str())
        .await
        .map_err(|e| format!("connect {authority}: {e}"))?;
    let device = stream.device().to_string();
    let io = TokioIo::new(stream);
    let (sender, conn) = if args.http2 {
        let (s, c) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
        (Sender::Http2(s), tokio::spawn(c))
    } else {
        let (s, c) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| format!("HTTP/1.1 handshake: {e}"))?;
        (
            Sender::Http1(Arc::new(tokio::sync::Mutex::new(s))),
            tokio::spawn(c),
        )
    };

    let start = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (sender, next, authority) = (sender.clone(), next.clone(), authority.clone());
            let (n, len, http2) = (args.requests, args.body_bytes, args.http2);
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return Ok::<_, String>(());
                    }
                    let body = body_for(i, len);
                    let req = request(http2, &authority, Method::POST, "/echo", body.clone());
                    let (status, got) = sender.send(req).await?;
                    if status != StatusCode::OK {
                        return Err(format!("request {i}: status {status}"));
                    }
                    verify(i, &body, &got)?;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.map_err(|e| format!("worker task: {e}"))??;
    }
    let secs = start.elapsed().as_secs_f64();

    let hello = request(args.http2, &authority, Method::GET, "/hello", Bytes::new());
    let (status, body) = sender.send(hello).await?;
    if status != StatusCode::OK {
        return Err(format!("GET /hello: status {status}"));
    }
    print!("{}", String::from_utf8_lossy(&body));

    drop(sender);
    conn.await
        .map_err(|e| format!("connection task: {e}"))?
        .map_err(|e| format!("connection: {e}"))?;
    let proto = if args.http2 { "HTTP/2" } else { "HTTP/1.1" };
    Ok(format!(
        "hyper_client: {} requests in {secs:.3} s, {:.1} req/s, {proto}, device {device}, verified",
        args.requests,
        args.requests as f64 / secs
    ))
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("hyper_client: {e}");
            ExitCode::FAILURE
        }
    }
}
