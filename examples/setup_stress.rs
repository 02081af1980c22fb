//! Connection setup under stress: N connect / echo / close cycles against
//! one server, sequential or C at once, on either tokio runtime, each in
//! this process or each in a fresh process (as a CLI tool or a test
//! runner connects: a fresh rdma_cm event thread every time). Prints the
//! failures by the error they ended with (a connect timeout by its
//! handshake stage), and the setup time's p50, p99 and slowest.
//!
//! ```text
//! setup_stress server 10.11.0.1:7003 [--kind stream|message]
//! setup_stress client 10.11.0.1:7003 --cycles 1000 [--concurrency 32] \
//!     [--runtime current|multi] [--kind stream|message] [--processes] \
//!     [--kill-every K [--kill-within-ms MS]]
//! setup_stress server ... --report-secs 5   # resources and open connections
//! ```
//!
//! `--kill-every` makes an accept burst with clients dying mid-handshake:
//! every K-th child is killed at a delay spread over the first
//! `--kill-within-ms`; the listener must go on serving the others, and
//! its process's resources (`--report-secs`) return to where they started
//! once the dead clients' half-open requests expired (the listener's
//! connect timeout, at least 60 s; see the trust model).
//!
//! Exit status 0 only if every cycle not killed on purpose connected,
//! echoed its bytes exactly and closed cleanly.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rdma::{Error, MessageEndpoint, MessageListener, RdmaListener, RdmaStream};

#[derive(Parser)]
#[command(about = "Connect/echo/close cycles against one server")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    /// `RdmaStream`.
    Stream,
    /// `MessageEndpoint`.
    Message,
}

#[derive(Clone, Copy, ValueEnum)]
enum Runtime {
    /// `current_thread`.
    Current,
    /// Multi-thread, 2 workers (what `#[tokio::main]` gives on 2 CPUs).
    Multi,
}

#[derive(Subcommand)]
enum Cmd {
    /// Echoes every connection until its peer closes.
    Server {
        addr: SocketAddr,
        #[arg(long, value_enum, default_value = "stream")]
        kind: Kind,
        /// Print the process's RDMA resources (`stats::resources()`) and
        /// the connections open every this many seconds (0: never).
        #[arg(long, default_value_t = 0)]
        report_secs: u64,
    },
    /// Runs the cycles.
    Client {
        addr: SocketAddr,
        /// Cycles in all.
        #[arg(long, default_value_t = 100)]
        cycles: u32,
        /// Cycles at once.
        #[arg(long, default_value_t = 1)]
        concurrency: u32,
        #[arg(long, value_enum, default_value = "multi")]
        runtime: Runtime,
        #[arg(long, value_enum, default_value = "stream")]
        kind: Kind,
        /// Each cycle in a fresh process (this binary, `client --cycles 1`).
        #[arg(long)]
        processes: bool,
        /// Round trips of 64 B per cycle.
        #[arg(long, default_value_t = 10)]
        round_trips: u32,
        /// With `--processes`: every this many cycles (the first, then
        /// each K-th) the child is killed (SIGKILL) after a delay spread
        /// over `--kill-within-ms`, wherever its connect or echo is then;
        /// those cycles count as killed, not as failures (0: none).
        #[arg(long, default_value_t = 0)]
        kill_every: u32,
        /// The spread of the kill delays, milliseconds.
        #[arg(long, default_value_t = 300)]
        kill_within_ms: u64,
    },
}

/// A cycle whose child was killed before it ended (`--kill-every`).
const KILLED: &str = "killed on purpose";

/// How a cycle ended: `Ok(setup time)` or the failure's label.
type Outcome = Result<Duration, String>;

fn label(e: &std::io::Error) -> String {
    match Error::from_io(e) {
        Some(Error::TimedOut { stage, .. }) => format!("timed out at {stage:?}"),
        Some(other) => format!("{other}"),
        None => format!("{:?}: {e}", e.kind()),
    }
}

async fn cycle(addr: SocketAddr, kind: Kind, round_trips: u32, seed: u32) -> Outcome {
    let t0 = Instant::now();
    let payload: Vec<u8> = (0..64u32).map(|i| (i ^ seed) as u8).collect();
    match kind {
        Kind::Stream => {
            let mut s = RdmaStream::connect(addr).await.map_err(|e| label(&e))?;
            let setup = t0.elapsed();
            let mut back = [0u8; 64];
            for _ in 0..round_trips {
                s.write_all(&payload).await.map_err(|e| label(&e))?;
                s.read_exact(&mut back).await.map_err(|e| label(&e))?;
                if back[..] != payload[..] {
                    return Err("echo returned other bytes".into());
                }
            }
            s.shutdown().await.map_err(|e| label(&e))?;
            let n = s.read(&mut back).await.map_err(|e| label(&e))?;
            if n != 0 {
                return Err(format!("{n} bytes after the echo"));
            }
            Ok(setup)
        }
        Kind::Message => {
            let ep = MessageEndpoint::connect(addr)
                .await
                .map_err(|e| label(&e))?;
            let setup = t0.elapsed();
            for _ in 0..round_trips {
                ep.send_copy(&payload).await.map_err(|e| label(&e))?;
                let m = ep
                    .recv()
                    .await
                    .map_err(|e| label(&e))?
                    .ok_or("the server closed")?;
                if m[..] != payload[..] {
                    return Err("echo returned other bytes".into());
                }
            }
            ep.close().await.map_err(|e| label(&e))?;
            Ok(setup)
        }
    }
}

/// One cycle in a fresh process of this binary; with `kill_after`, the
/// child is killed (SIGKILL) that long after it started if it still runs.
async fn cycle_in_process(
    addr: SocketAddr,
    args: &[String],
    kill_after: Option<Duration>,
) -> Outcome {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = tokio::process::Command::new(exe)
        .args([
            "client",
            &addr.to_string(),
            "--cycles",
            "1",
            "--concurrency",
            "1",
        ])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| e.to_string())?;
    if let Some(after) = kill_after {
        if tokio::time::timeout(after, child.wait()).await.is_err() {
            child.start_kill().map_err(|e| e.to_string())?;
            child.wait().await.map_err(|e| e.to_string())?;
            return Err(KILLED.into());
        }
    }
    let out = child.wait_with_output().await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    // The child's summary line: "setup_us <n>" on success.
    if let Some(us) = text
        .lines()
        .find_map(|l| l.strip_prefix("setup_us "))
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        if out.status.success() {
            return Ok(Duration::from_micros(us));
        }
    }
    Err(text
        .lines()
        .find_map(|l| l.strip_prefix("failure "))
        .map(str::to_string)
        .unwrap_or_else(|| format!("child exited {}", out.status)))
}

#[allow(clippy::too_many_arguments)]
async fn client(
    addr: SocketAddr,
    cycles: u32,
    concurrency: u32,
    kind: Kind,
    processes: bool,
    round_trips: u32,
    child_args: Vec<String>,
    kill_every: u32,
    kill_within: Duration,
) -> bool {
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1) as usize));
    let child_args = Arc::new(child_args);
    let mut tasks = Vec::new();
    let t0 = Instant::now();
    for i in 0..cycles {
        let permit = Arc::clone(&sem).acquire_owned().await.expect("semaphore");
        let child_args = Arc::clone(&child_args);
        tasks.push(tokio::spawn(async move {
            // Delays spread over `kill_within` by a multiplicative hash of
            // the cycle number (the same spread in every run).
            let kill_after = (kill_every > 0 && i % kill_every == 0).then(|| {
                let spread = kill_within.as_micros().max(1) as u64;
                Duration::from_micros(u64::from(i).wrapping_mul(0x9E37_79B9) % spread)
            });
            let r = if processes {
                cycle_in_process(addr, &child_args, kill_after).await
            } else {
                cycle(addr, kind, round_trips, i).await
            };
            drop(permit);
            r
        }));
    }
    let mut hist = Histogram::<u64>::new(3).expect("histogram");
    let mut failures: BTreeMap<String, u32> = BTreeMap::new();
    let mut killed = 0u32;
    for t in tasks {
        match t.await.expect("cycle task") {
            Ok(setup) => {
                hist.record(setup.as_micros() as u64).ok();
            }
            Err(l) if l == KILLED => killed += 1,
            Err(l) => *failures.entry(l).or_default() += 1,
        }
    }
    let failed: u32 = failures.values().sum();
    if cycles == 1 {
        // A child's result, for the parent.
        match failures.keys().next() {
            None => println!("setup_us {}", hist.max()),
            Some(l) => println!("failure {l}"),
        }
        return failed == 0;
    }
    println!(
        "{cycles} cycles ({concurrency} at once{}) in {:.1} s: {} ok, {failed} failed{}",
        if processes { ", a process each" } else { "" },
        t0.elapsed().as_secs_f64(),
        cycles - failed - killed,
        if killed > 0 {
            format!(", {killed} killed on purpose")
        } else {
            String::new()
        }
    );
    for (l, n) in &failures {
        println!("  failed: {n} x {l}");
    }
    if !hist.is_empty() {
        println!(
            "  setup (connect returned) p50 {:.2} ms, p99 {:.2} ms, slowest {:.2} ms",
            hist.value_at_quantile(0.5) as f64 / 1e3,
            hist.value_at_quantile(0.99) as f64 / 1e3,
            hist.max() as f64 / 1e3
        );
    }
    failed == 0
}

async fn server(addr: SocketAddr, kind: Kind, report_secs: u64) -> std::io::Result<()> {
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    if report_secs > 0 {
        let open = Arc::clone(&open);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(report_secs));
            loop {
                tick.tick().await;
                println!(
                    "connections {} resources {:?}",
                    open.load(std::sync::atomic::Ordering::Relaxed),
                    tokio_rdma::stats::resources()
                );
            }
        });
    }
    // Counts one open connection until dropped.
    struct Open(Arc<std::sync::atomic::AtomicUsize>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let opened = move || {
        open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Open(Arc::clone(&open))
    };
    match kind {
        Kind::Stream => {
            let l = RdmaListener::bind(addr).await?;
            eprintln!("listening on {}", l.local_addr()?);
            loop {
                let (mut s, _) = l.accept().await?;
                let open = opened();
                tokio::spawn(async move {
                    let _open = open;
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        }
        Kind::Message => {
            let l = MessageListener::bind(addr).await?;
            eprintln!("listening on {}", l.local_addr()?);
            loop {
                let (ep, _) = l.accept().await?;
                let open = opened();
                tokio::spawn(async move {
                    let _open = open;
                    while let Ok(Some(m)) = ep.recv().await {
                        if ep.send(m).await.is_err() {
                            break;
                        }
                    }
                    let _ = ep.close().await;
                });
            }
        }
    }
}

fn runtime(r: Runtime) -> tokio::runtime::Runtime {
    match r {
        Runtime::Current => tokio::runtime::Builder::new_current_thread(),
        Runtime::Multi => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(2);
            b
        }
    }
    .enable_all()
    .build()
    .expect("runtime")
}

fn main() -> ExitCode {
    match Cli::parse().cmd {
        Cmd::Server {
            addr,
            kind,
            report_secs,
        } => match runtime(Runtime::Multi).block_on(server(addr, kind, report_secs)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("setup_stress server: {e}");
                ExitCode::FAILURE
            }
        },
        Cmd::Client {
            addr,
            cycles,
            concurrency,
            runtime: rt,
            kind,
            processes,
            round_trips,
            kill_every,
            kill_within_ms,
        } => {
            let child_args = vec![
                "--runtime".into(),
                match rt {
                    Runtime::Current => "current",
                    Runtime::Multi => "multi",
                }
                .into(),
                "--kind".into(),
                match kind {
                    Kind::Stream => "stream",
                    Kind::Message => "message",
                }
                .into(),
                "--round-trips".into(),
                round_trips.to_string(),
            ];
            // The parent of per-process cycles only waits for children.
            let rt = if processes { Runtime::Current } else { rt };
            let ok = runtime(rt).block_on(client(
                addr,
                cycles,
                concurrency,
                kind,
                processes,
                round_trips,
                child_args,
                kill_every,
                Duration::from_millis(kill_within_ms),
            ));
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
