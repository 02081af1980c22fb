//! An HTTP server on hyper 1.x over [`RdmaStream`]s.
//!
//! ```text
//! hyper_server 10.11.0.1:8080            # HTTP/1.1
//! hyper_server 10.11.0.1:8080 --http2    # HTTP/2 (prior knowledge, no upgrade)
//! ```
//!
//! Routes:
//! - `GET /hello`: `hello over RDMA\n`
//! - `POST /echo`: the request body, streamed back as it arrives
//! - `GET /bytes/N`: N bytes of the pattern `(i % 251) as u8`
//!
//! Anything else is `404 Not Found`. Every connection is served in its own
//! task; connection errors go to stderr. `hyper_client` is the matching
//! client.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;

use bytes::Bytes;
use clap::Parser;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio_rdma::{RdmaListener, RdmaStream};

/// Largest body `GET /bytes/N` serves (1 GiB).
const MAX_BYTES: usize = 1 << 30;

/// Command line.
#[derive(Parser)]
#[command(about = "HTTP server (hyper) over RDMA streams")]
struct Args {
    /// Address to listen on (an IP of an RDMA device, port 0 for any).
    addr: SocketAddr,
    /// Speak HTTP/2 (prior knowledge) instead of HTTP/1.1.
    #[arg(long)]
    http2: bool,
}

/// The response body type of every route.
type Body = BoxBody<Bytes, hyper::Error>;

/// A complete in-memory body.
fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// A response with `status` and a short text body.
fn text(status: StatusCode, msg: &'static str) -> Response<Body> {
    let mut r = Response::new(full(msg));
    *r.status_mut() = status;
    r
}

/// `n` bytes of the `/bytes/N` pattern: byte `i` is `(i % 251) as u8`.
fn pattern_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

/// Routes one request.
async fn handle(req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path();
    let resp = match (req.method(), path) {
        (&Method::GET, "/hello") => Response::new(full("hello over RDMA\n")),
        // Stream the body back: the response starts before the upload ends,
        // so both directions are in flight at once.
        (&Method::POST, "/echo") => Response::new(req.into_body().boxed()),
        (&Method::GET, p) if p.starts_with("/bytes/") => {
            match p["/bytes/".len()..].parse::<usize>() {
                Ok(n) if n <= MAX_BYTES => Response::new(full(pattern_bytes(n))),
                Ok(_) => text(StatusCode::PAYLOAD_TOO_LARGE, "at most 1 GiB\n"),
                Err(_) => text(StatusCode::BAD_REQUEST, "usage: /bytes/N\n"),
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    };
    Ok(resp)
}

/// Serves one connection until the peer closes it.
async fn serve(stream: RdmaStream, http2: bool) -> Result<(), hyper::Error> {
    let io = TokioIo::new(stream);
    if http2 {
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(io, service_fn(handle))
            .await
    } else {
        hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service_fn(handle))
            .await
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let listener = match RdmaListener::bind(args.addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("hyper_server: bind {}: {e}", args.addr);
            return ExitCode::FAILURE;
        }
    };
    let proto = if args.http2 { "HTTP/2" } else { "HTTP/1.1" };
    match listener.local_addr() {
        Ok(a) => eprintln!("hyper_server: {proto} listening on {a}"),
        Err(e) => eprintln!("hyper_server: {proto} listening (local_addr: {e})"),
    }
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let http2 = args.http2;
                tokio::spawn(async move {
                    if let Err(e) = serve(stream, http2).await {
                        eprintln!("hyper_server: connection from {peer}: {e}");
                    }
                });
            }
            Err(e) => {
                eprintln!("hyper_server: accept: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
}
