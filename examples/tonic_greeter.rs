//! A gRPC greeter over TCP or RDMA, chosen by the address alone.
//!
//! ```text
//! cargo run --features tonic --example tonic_greeter -- server rdma://10.11.0.1:50051
//! cargo run --features tonic --example tonic_greeter -- client rdma://10.11.0.1:50051 --name you
//! ```
//!
//! `tcp://`, `rdma://` and `auto://` all work on both sides; an `auto://`
//! server listens on TCP and RDMA at the same port number. The service is
//! written by hand against tonic (raw-bytes messages, no protoc): see
//! `tests/transport_suite/greeter.rs`. The client calls the unary,
//! server-streaming and bidirectional-streaming methods and exits non-zero
//! if an answer is wrong.

#[path = "../tests/transport_suite/greeter.rs"]
mod greeter;

use bytes::Bytes;
use clap::{Parser, Subcommand};
use futures::StreamExt;
use tokio_rdma::transport::{Listener, TransportAddr};

use greeter::{GreeterClient, GreeterServer};

#[derive(Parser)]
#[command(about = "gRPC greeter over tcp://, rdma:// or auto:// addresses")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the greeter on ADDR until killed.
    Server {
        /// For example rdma://10.11.0.1:50051, tcp://0.0.0.0:50051, auto://0.0.0.0:50051.
        addr: TransportAddr,
    },
    /// Call every method once on the server at ADDR.
    Client {
        /// The server's address, for example rdma://10.11.0.1:50051.
        addr: TransportAddr,
        /// The name to greet.
        #[arg(long, default_value = "world")]
        name: String,
        /// Messages for the streaming calls.
        #[arg(long, default_value_t = 5)]
        count: u32,
    },
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    match Args::parse().cmd {
        Cmd::Server { addr } => {
            let listener = Listener::bind(&addr).await?;
            println!(
                "greeter listening on {} ({}://{})",
                addr,
                listener.transport(),
                listener.local_addr()?
            );
            tonic::transport::Server::builder()
                .add_service(GreeterServer)
                .serve_with_incoming(listener.into_incoming())
                .await?;
        }
        Cmd::Client { addr, name, count } => {
            let channel = tokio_rdma::transport::channel(&addr).await?;
            let mut client = GreeterClient::new(channel);
            println!("{}", client.say_hello(&name).await?);

            let numbers: Vec<String> = client
                .count(count)
                .await?
                .map(|m| m.map(|b| String::from_utf8_lossy(&b).into_owned()))
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<Result<_, _>>()?;
            println!("count({count}) -> {}", numbers.join(" "));
            let want: Vec<String> = (0..count).map(|i| i.to_string()).collect();
            if numbers != want {
                return Err("server streaming answer is wrong".into());
            }

            let sent: Vec<Bytes> = (0..count)
                .map(|i| Bytes::from(format!("ping {i}")))
                .collect();
            let echoed: Vec<Bytes> = client
                .echo(futures::stream::iter(sent.clone()))
                .await?
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<Result<_, _>>()?;
            println!(
                "echo: {} of {} messages came back",
                echoed.len(),
                sent.len()
            );
            if echoed != sent {
                return Err("bidirectional echo is wrong".into());
            }
        }
    }
    Ok(())
}
