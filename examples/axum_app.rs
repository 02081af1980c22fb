//! An axum app served over TCP, RDMA or both, with `ConnectInfo` telling
//! each handler the peer's address and the transport.
//!
//! ```text
//! cargo run --features axum,hyper --example axum_app -- auto://0.0.0.0:3000
//! curl http://127.0.0.1:3000/            # over TCP
//! cargo run --features axum,hyper --example axum_app -- rdma://10.11.0.1:3000 --probe
//! ```
//!
//! With `--probe` it also sends `GET /` and `POST /echo` to itself through
//! the crate's hyper connector (over the address's transport), prints the
//! answers and exits; non-zero if an answer is wrong.

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio_rdma::transport::{ConnectionInfo, Connector, Listener, TransportAddr};

#[derive(Parser)]
#[command(about = "axum over tcp://, rdma:// or auto:// addresses")]
struct Args {
    /// Where to listen, for example auto://0.0.0.0:3000.
    addr: TransportAddr,
    /// Request the app once and exit.
    #[arg(long)]
    probe: bool,
}

async fn hello(ConnectInfo(info): ConnectInfo<ConnectionInfo>) -> String {
    format!("hello {} over {}\n", info.peer, info.transport)
}

async fn echo(body: Bytes) -> Bytes {
    body
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let app = Router::new()
        .route("/", get(hello))
        .route("/echo", post(echo));
    let listener = Listener::bind(&args.addr).await?;
    let port = listener.local_addr()?.port();
    println!("axum_app listening on {} (port {port})", args.addr);
    let server = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<ConnectionInfo>(),
    );
    if !args.probe {
        server.await?;
        return Ok(());
    }
    tokio::spawn(async move { server.await });

    let mut host = args.addr.host().to_string();
    if host == "0.0.0.0" {
        host = "127.0.0.1".into();
    }
    let client: Client<Connector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(Connector::new(args.addr.transport()));
    let res = client
        .get(format!("http://{host}:{port}/").parse()?)
        .await?;
    let info = *res
        .extensions()
        .get::<ConnectionInfo>()
        .ok_or("no ConnectionInfo")?;
    let body = res.into_body().collect().await?.to_bytes();
    print!(
        "GET / via {} -> {}",
        info.transport,
        String::from_utf8_lossy(&body)
    );
    if body != format!("hello {} over {}\n", info.local, info.transport) {
        return Err("GET / answered something else".into());
    }
    let payload = Bytes::from(vec![7u8; 100_000]);
    let req = http::Request::post(format!("http://{host}:{port}/echo"))
        .body(Full::new(payload.clone()))?;
    let body = client
        .request(req)
        .await?
        .into_body()
        .collect()
        .await?
        .to_bytes();
    println!(
        "POST /echo: {} bytes sent, {} bytes back, equal: {}",
        payload.len(),
        body.len(),
        body == payload
    );
    if body != payload {
        return Err("POST /echo answered something else".into());
    }
    Ok(())
}
