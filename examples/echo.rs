//! Echo over RdmaStream.
//!
//! ```text
//! echo server 10.11.0.1:7471
//! echo client 10.11.0.1:7471 --bytes 1048576 --conns 4
//! ```
//!
//! The client sends N bytes of a deterministic pattern on each of C
//! connections while reading the echo, checks every byte, and prints one
//! line: bytes, seconds, MB/s and the device used.

use std::net::SocketAddr;
use std::time::Instant;

use clap::{Parser, Subcommand};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rdma::{RdmaListener, RdmaStream};

#[path = "shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

#[path = "shared/echo.rs"]
mod echo_loop;
use echo_loop::echo as serve;

#[derive(Parser)]
#[command(about = "Echo server and client over RDMA streams")]
struct Args {
    /// Log the connection's setup and errors (tracing, debug level) to
    /// stderr.
    #[arg(long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve every connection: echo until EOF, then half-close.
    Server {
        /// Address to listen on (an IP of an RDMA device).
        addr: SocketAddr,
    },
    /// Send, verify and time.
    Client {
        /// Server address.
        addr: SocketAddr,
        /// Bytes per connection.
        #[arg(long, default_value_t = 1 << 20)]
        bytes: u64,
        /// Concurrent connections.
        #[arg(long, default_value_t = 1)]
        conns: usize,
    },
}

/// Byte `i` of connection `c`'s pattern: a splitmix64 hash of (c, i / 8),
/// with no period shorter than 2^64 bytes.
fn pattern(c: usize, i: u64) -> u8 {
    let seed = c as u64;
    shared::pattern_byte(seed, i)
}

async fn client(addr: SocketAddr, c: usize, bytes: u64) -> Result<String, String> {
    let s = RdmaStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let device = s.device().to_string();
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut sent = 0u64;
        while sent < bytes {
            let n = (bytes - sent).min(buf.len() as u64) as usize;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern(c, sent + k as u64);
            }
            wr.write_all(&buf[..n]).await?;
            sent += n as u64;
        }
        wr.shutdown().await?;
        Ok::<_, std::io::Error>(wr)
    });
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0u64;
    loop {
        let n = rd.read(&mut buf).await.map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            break;
        }
        for (k, &b) in buf[..n].iter().enumerate() {
            let want = pattern(c, got + k as u64);
            if b != want {
                return Err(format!(
                    "conn {c}: byte {} is {b:#04x}, expected {want:#04x}",
                    got + k as u64
                ));
            }
        }
        got += n as u64;
    }
    let _wr = writer
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("write: {e}"))?;
    if got != bytes {
        return Err(format!("conn {c}: echoed {got} bytes, sent {bytes}"));
    }
    Ok(device)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if args.verbose {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(std::io::stderr)
            .init();
    }
    match args.cmd {
        Cmd::Server { addr } => {
            let l = match RdmaListener::bind(addr).await {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("bind {addr}: {e}");
                    return std::process::ExitCode::FAILURE;
                }
            };
            eprintln!("echo server listening on {}", l.local_addr().unwrap());
            loop {
                match l.accept().await {
                    Ok((s, _peer)) => {
                        tokio::spawn(async move {
                            if let Err(e) = serve(s).await {
                                eprintln!("echo server: {e}");
                            }
                        });
                    }
                    Err(e) => {
                        eprintln!("accept: {e}");
                        return std::process::ExitCode::FAILURE;
                    }
                }
            }
        }
        Cmd::Client { addr, bytes, conns } => {
            let start = Instant::now();
            let tasks: Vec<_> = (0..conns)
                .map(|c| tokio::spawn(client(addr, c, bytes)))
                .collect();
            let mut device = String::new();
            for t in tasks {
                match t.await {
                    Ok(Ok(d)) => device = d,
                    Ok(Err(e)) => {
                        eprintln!("echo client: {e}");
                        return std::process::ExitCode::FAILURE;
                    }
                    Err(e) => {
                        eprintln!("echo client task: {e}");
                        return std::process::ExitCode::FAILURE;
                    }
                }
            }
            let secs = start.elapsed().as_secs_f64();
            let total = bytes * conns as u64;
            println!(
                "echo: {total} bytes on {conns} connection(s) in {secs:.3} s, {:.2} MB/s, device {device}, verified",
                total as f64 / secs / 1e6
            );
            std::process::ExitCode::SUCCESS
        }
    }
}
