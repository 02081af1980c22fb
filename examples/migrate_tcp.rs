//! One HTTP service, moved between TCP and RDMA by its address string only.
//!
//! ```text
//! # the same binary, the same code; only the address differs:
//! cargo run --features hyper --example migrate_tcp -- serve tcp://0.0.0.0:8080
//! cargo run --features hyper --example migrate_tcp -- serve rdma://10.11.0.1:8080
//! cargo run --features hyper --example migrate_tcp -- serve auto://0.0.0.0:8080
//!
//! cargo run --features hyper --example migrate_tcp -- call tcp://127.0.0.1:8080
//! cargo run --features hyper --example migrate_tcp -- call rdma://10.11.0.1:8080
//!
//! # both in one process (what the guest demo runs once per transport):
//! cargo run --features hyper --example migrate_tcp -- demo rdma://10.11.0.1:0
//! ```
//!
//! The service answers `GET /` with its view of the connection and echoes
//! `POST` bodies. A TCP service becomes this by replacing
//! `TcpListener::bind("0.0.0.0:8080")` with `Listener::bind(addr)` and
//! hyper_util's `HttpConnector` with `Connector`: nothing else changes.

use std::convert::Infallible;

use bytes::Bytes;
use clap::{Parser, Subcommand};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio_rdma::transport::{ConnectionInfo, Connector, Listener, TransportAddr};

#[derive(Parser)]
#[command(about = "one HTTP service over tcp://, rdma:// or auto://, by address")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve on ADDR until killed.
    Serve {
        /// tcp://, rdma:// or auto://host:port.
        addr: TransportAddr,
    },
    /// Call the service at ADDR: GET / and a POST echo.
    Call {
        /// tcp://, rdma:// or auto://host:port of the server.
        addr: TransportAddr,
        /// Bytes in the POST body.
        #[arg(long, default_value_t = 65536)]
        size: usize,
    },
    /// Serve on ADDR (port 0 picks one) and call it from the same process.
    Demo {
        /// tcp://, rdma:// or auto://host:port.
        addr: TransportAddr,
        /// Bytes in the POST body.
        #[arg(long, default_value_t = 65536)]
        size: usize,
    },
}

/// The service: the code a TCP program already has.
async fn handle(
    info: ConnectionInfo,
    req: http::Request<Incoming>,
) -> Result<http::Response<Full<Bytes>>, hyper::Error> {
    if req.method() == http::Method::POST {
        let body = req.into_body().collect().await?.to_bytes();
        return Ok(http::Response::new(Full::new(body)));
    }
    Ok(http::Response::new(Full::new(Bytes::from(format!(
        "served {} over {}\n",
        info.peer, info.transport
    )))))
}

async fn serve(listener: Listener) -> std::io::Result<Infallible> {
    loop {
        let (stream, _peer) = listener.accept().await?;
        let info = stream.connection_info()?;
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(info, req));
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                eprintln!("connection from {}: {e}", info.peer);
            }
        });
    }
}

async fn call(addr: &TransportAddr, size: usize) -> Result<(), Box<dyn std::error::Error>> {
    let client: Client<Connector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(Connector::new(addr.transport()));
    let host = if addr.host().contains(':') {
        format!("[{}]", addr.host())
    } else {
        addr.host().to_string()
    };
    let base = format!("http://{host}:{}", addr.port());
    let res = client.get(format!("{base}/").parse()?).await?;
    let info = *res
        .extensions()
        .get::<ConnectionInfo>()
        .ok_or("no ConnectionInfo")?;
    let body = res.into_body().collect().await?.to_bytes();
    print!(
        "{addr}: connected over {} ({} -> {}); server says: {}",
        info.transport,
        info.local,
        info.peer,
        String::from_utf8_lossy(&body)
    );
    let payload = Bytes::from((0..size).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let started = std::time::Instant::now();
    let req = http::Request::post(format!("{base}/echo")).body(Full::new(payload.clone()))?;
    let back = client
        .request(req)
        .await?
        .into_body()
        .collect()
        .await?
        .to_bytes();
    println!(
        "{addr}: echoed {} bytes in {:?}, equal: {}",
        back.len(),
        started.elapsed(),
        back == payload
    );
    if back != payload {
        return Err("echo differs".into());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colours only on a terminal, not in a captured log.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Args::parse().cmd {
        Cmd::Serve { addr } => {
            let listener = Listener::bind(&addr).await?;
            println!("serving on {addr} (bound {})", listener.local_addr()?);
            serve(listener).await?;
        }
        Cmd::Call { addr, size } => call(&addr, size).await?,
        Cmd::Demo { addr, size } => {
            let listener = Listener::bind(&addr).await?;
            let port = listener.local_addr()?.port();
            tokio::spawn(serve(listener));
            let mut target = addr.with_port(port);
            if target.host() == "0.0.0.0" {
                target = TransportAddr::new(target.transport(), "127.0.0.1", port);
            }
            call(&target, size).await?;
        }
    }
    Ok(())
}
