//! Guest tests for many connections (run inside the Soft-RoCE guest by
//! `scripts/test`; they fail, never skip, without rxe0): a thousand
//! concurrent streams moving data, thousands of idle ones and what they
//! pin, churn, and refused connects, each ending with the process's verbs
//! objects and file descriptors back where they started.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it).
//! The binary runs with `--test-threads=1`, so the process-wide counts of
//! [`tokio_rdma::stats::resources`] change only through the test running.
#![cfg(tokio_rdma_guest)]

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;
use tokio_rdma::error::RejectReason;
use tokio_rdma::stats::{ResourceSnapshot, resources};
use tokio_rdma::{Error, MessageListener, RdmaConfig, RdmaListener, RdmaStream};

mod common;
use common::{Phases, assert_back_to, example, open_fds, without_cache};

#[path = "../examples/shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

const IP: &str = "10.11.0.1";

/// Generous liveness bounds (TCG is slow); never speed assertions.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(240);
const SETTLE: Duration = Duration::from_secs(120);

/// The default receive ring, which is all an idle stream keeps registered.
const RING: u64 = 64 * 1024;

fn pattern(seed: u64, i: u64) -> u8 {
    shared::pattern_byte(seed, i)
}

/// A listener with `cfg` (the default backlog), and one connection made and closed
/// first so the device is open before the counts are taken.
async fn listener(cfg: &RdmaConfig) -> (RdmaListener, SocketAddr, ResourceSnapshot, usize) {
    let l = RdmaListener::bind_with(format!("{IP}:0"), cfg)
        .await
        .expect("bind");
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(RdmaStream::connect_with(addr, cfg), l.accept());
    let (mut c, (mut s, _)) = (c.unwrap(), s.unwrap());
    c.write_all(b"warm").await.unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).await.unwrap();
    drop((c, s));
    // The warm-up's QPs go away in the background.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let deadline = Instant::now() + SETTLE;
    while resources().queue_pairs != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(resources().queue_pairs, 0, "warm-up connection gone");
    (l, addr, resources(), open_fds())
}

/// Waits until every stream's send buffer went back (the stream is idle)
/// and returns the registered bytes each holds.
async fn settled_registered(streams: &[RdmaStream]) -> Vec<u64> {
    let deadline = Instant::now() + SETTLE;
    loop {
        let got: Vec<u64> = streams.iter().map(|s| s.stats().registered_bytes).collect();
        if got.iter().all(|&b| b == RING) || Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// 1,000 streams connect at once to a listener with the default backlog
/// (none refused); each sends 16 pipelined 4 KiB writes and reads the 64 KiB
/// echoed back, bytes equal. Held open afterwards, each end pins only its
/// 64 KiB ring (send buffers go back when idle); closed, everything is
/// released. The listener keeps the default config: it waits for each
/// handshake's CM verdict, not for its own 10 s connect timeout (when it
/// did, one slow guest boot gave up a handshake whose client was already
/// connected, and that client saw `PeerDisconnected`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_streams_echo_then_idle_ones_pin_only_their_ring() {
    const N: usize = 1000;
    const WRITES: u64 = 16;
    const WRITE: u64 = 4096;
    let (l, addr, start, fds) = listener(&RdmaConfig::default()).await;
    let server = tokio::spawn(async move {
        let mut echoes = JoinSet::new();
        for _ in 0..N {
            let (mut s, _) = l.accept().await.unwrap();
            echoes.spawn(async move {
                let mut buf = vec![0u8; (WRITES * WRITE) as usize];
                s.read_exact(&mut buf).await?;
                s.write_all(&buf).await?;
                Ok::<_, io::Error>(s)
            });
        }
        let mut held = Vec::with_capacity(N);
        while let Some(r) = echoes.join_next().await {
            held.push(r.unwrap().expect("server echo"));
        }
        (l, held)
    });
    let cfg = RdmaConfig::new().connect_timeout(CONNECT_TIMEOUT);
    let mut clients = JoinSet::new();
    for seed in 0..N as u64 {
        let cfg = cfg.clone();
        clients.spawn(async move {
            let mut s = RdmaStream::connect_with(addr, &cfg).await?;
            let mut buf = vec![0u8; WRITE as usize];
            for w in 0..WRITES {
                for (k, b) in buf.iter_mut().enumerate() {
                    *b = pattern(seed, w * WRITE + k as u64);
                }
                s.write_all(&buf).await?;
            }
            let mut back = vec![0u8; (WRITES * WRITE) as usize];
            s.read_exact(&mut back).await?;
            for (i, &b) in back.iter().enumerate() {
                assert_eq!(
                    b,
                    pattern(seed, i as u64),
                    "stream {seed}: byte {i} differs"
                );
            }
            Ok::<_, io::Error>(s)
        });
    }
    let mut held = Vec::with_capacity(N);
    while let Some(r) = clients.join_next().await {
        held.push(r.unwrap().expect("connect and echo"));
    }
    let (l, server_held) = server.await.unwrap();
    assert_eq!((held.len(), server_held.len()), (N, N));
    held.extend(server_held);

    let per_stream = settled_registered(&held).await;
    assert_eq!(
        per_stream,
        vec![RING; 2 * N],
        "each idle end pins its ring only"
    );
    let now = resources();
    assert_eq!(now.queue_pairs - start.queue_pairs, 2 * N as u64);
    assert_eq!(now.memory_windows - start.memory_windows, 2 * N as u64);
    // By default every end has a CQ of its own (the first 64 with a
    // completion channel of their own too).
    assert_cqs(start, now, 2 * N as u64, 0, STREAM_QPS_PER_CQ);
    assert_eq!(now.completion_channels - start.completion_channels, 64);
    assert_eq!(
        without_cache(now).4 - without_cache(start).4,
        2 * N as u64 * RING,
        "{now:?}"
    );
    drop(held);
    assert_back_to(start, fds, 2, SETTLE).await;
    drop(l);
}

/// QPs one shared CQ seats with the default stream depths: 16,384 entries
/// / (130 send WRs: the stream's 128, the keepalive probe and a grown
/// ring's window bind; + 128 receive WRs + 16) = 59.8.
const STREAM_QPS_PER_CQ: u64 = 59;

/// Asserts the CQs held at `now` beyond `start`: `own` QPs with a CQ of
/// their own, and `sharing` QPs on shared CQs filled one after the other,
/// `per_cq` QPs each.
fn assert_cqs(start: ResourceSnapshot, now: ResourceSnapshot, own: u64, sharing: u64, per_cq: u64) {
    let shared = sharing.div_ceil(per_cq);
    assert_eq!(
        now.shared_completion_queues - start.shared_completion_queues,
        shared,
        "{now:?}"
    );
    assert_eq!(
        now.completion_queues - start.completion_queues,
        own + shared,
        "{now:?}"
    );
}

/// 4,000 idle connections (8,000 stream ends in this process) on shared
/// CQs (`share_completion_queue`) held open at once: every end pins its
/// 64 KiB ring and nothing else, holds a QP, a seat on one of 134 CQs and
/// no fd, and all of it goes back when they close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_thousand_idle_connections_pin_at_most_64_kib_each() {
    const N: usize = 4000;
    const AT_ONCE: usize = 256;
    let cfg = RdmaConfig::new()
        .connect_timeout(CONNECT_TIMEOUT)
        .share_completion_queue(true);
    let mut phases = Phases::start();
    let (l, addr, start, fds) = listener(&cfg).await;
    let server = tokio::spawn(async move {
        let mut held = Vec::with_capacity(N);
        while held.len() < N {
            held.push(l.accept().await.unwrap().0);
        }
        (l, held)
    });
    let mut held = Vec::with_capacity(N);
    while held.len() < N {
        let mut batch = JoinSet::new();
        for _ in 0..AT_ONCE.min(N - held.len()) {
            let cfg = cfg.clone();
            batch.spawn(async move { RdmaStream::connect_with(addr, &cfg).await });
        }
        while let Some(r) = batch.join_next().await {
            held.push(r.unwrap().expect("connect"));
        }
    }
    let (l, server_held) = server.await.unwrap();
    held.extend(server_held);
    phases.done("4,000 connects");
    let total: u64 = held.iter().map(|s| s.stats().registered_bytes).sum();
    assert_eq!(total, 2 * N as u64 * RING);
    assert!(total / (2 * N as u64) <= 64 * 1024);
    let now = resources();
    assert_eq!(
        without_cache(now).4 - without_cache(start).4,
        2 * N as u64 * RING,
        "{now:?}"
    );
    assert_eq!(now.queue_pairs - start.queue_pairs, 2 * N as u64);
    // Shared CQs: 60 ends on each, none with a CQ of its own.
    assert_cqs(start, now, 0, 2 * N as u64, STREAM_QPS_PER_CQ);
    // Fds: none per connection. The shared CQs report to the runtime's
    // completion channel (opened with the warm-up connection), and every
    // rdma_cm event goes to the process's channel.
    assert_eq!(
        now.completion_channels, start.completion_channels,
        "{now:?}"
    );
    assert_eq!(now.cm_event_channels, start.cm_event_channels, "{now:?}");
    assert_eq!(
        now.shared_event_channels, start.shared_event_channels,
        "{now:?}"
    );
    assert_eq!(open_fds(), fds, "no fds for 8,000 ends");
    println!(
        "{} stream ends: {} bytes registered in all ({} per end), {} QPs, {} CQs ({} shared), {} fds",
        2 * N,
        now.registered_bytes,
        now.registered_bytes / (2 * N as u64),
        now.queue_pairs,
        now.completion_queues,
        now.shared_completion_queues,
        open_fds()
    );
    phases.done("counts");
    drop(held);
    assert_back_to(start, fds, 2, SETTLE).await;
    phases.done("8,000 ends dropped and released");
    drop(l);
}

/// 2,000 sequential connect, 8 KiB echo, close: all succeed, and the fds
/// and verbs objects end where they started (fds within 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_of_2000_connections_leaks_nothing() {
    const N: u64 = 2000;
    const LEN: usize = 8192;
    let (l, addr, start, fds) = listener(&RdmaConfig::default()).await;
    let server = tokio::spawn(async move {
        for _ in 0..N {
            let (mut s, _) = l.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = vec![0u8; LEN];
                s.read_exact(&mut buf).await.unwrap();
                s.write_all(&buf).await.unwrap();
            });
        }
        l
    });
    for seed in 0..N {
        let mut s = RdmaStream::connect(addr).await.expect("connect");
        let data: Vec<u8> = (0..LEN as u64).map(|i| pattern(seed, i)).collect();
        s.write_all(&data).await.unwrap();
        let mut back = vec![0u8; LEN];
        s.read_exact(&mut back).await.unwrap();
        assert!(back == data, "connection {seed}: echo differs");
    }
    let l = server.await.unwrap();
    assert_back_to(start, fds, 2, SETTLE).await;
    drop(l);
}

/// 2,000 connects to a port with no listener: each is `ConnectionRefused`
/// (`Error::ConnectionRefused`) well within the connect timeout, and nothing
/// is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connects_to_a_port_without_listener_are_refused_and_leak_nothing() {
    const N: usize = 2000;
    let (l, _, start, fds) = listener(&RdmaConfig::default()).await;
    let closed: SocketAddr = {
        let other = RdmaListener::bind(format!("{IP}:0")).await.unwrap();
        other.local_addr().unwrap()
    };
    let cfg = RdmaConfig::new().connect_timeout(Duration::from_secs(30));
    for i in 0..N {
        let err = RdmaStream::connect_with(closed, &cfg)
            .await
            .expect_err("nothing listens there");
        assert_eq!(
            err.kind(),
            io::ErrorKind::ConnectionRefused,
            "connect {i}: {err}"
        );
        assert!(
            matches!(Error::from_io(&err), Some(Error::ConnectionRefused { addr }) if *addr == closed),
            "connect {i}: {err:?}"
        );
    }
    assert_back_to(start, fds, 2, SETTLE).await;
    drop(l);
}

/// Resident set size of this process, bytes (`/proc/self/statm`).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|f| f.parse().ok())
        .expect("statm's resident field");
    pages * 4096
}

/// RSS growth allowed over a volume run once every path ran 100 times:
/// the allocator keeps freed memory, a leak of 1 KiB per failure would
/// pass 16 MiB by 16,000.
const RSS_SLACK: u64 = 16 << 20;

/// Every failure path of connection setup, `n` times each: a connect to a
/// port with no listener (`ConnectionRefused`), to an address no RDMA
/// device has (127.0.0.1: `Error::Unreachable`, `NotFound`), to a
/// listener of the other kind (`Error::HandshakeRejected`,
/// `RejectReason::WrongKind`), and a bind to an address in use
/// (`AddrInUse`); each the exact error, every time. Afterwards the verbs
/// objects and fds are back where they started and RSS grew by less than
/// [`RSS_SLACK`] since the first 100 rounds.
async fn failure_paths(n: usize) {
    let (l, in_use, start, fds) = listener(&RdmaConfig::default()).await;
    let closed: SocketAddr = {
        let other = RdmaListener::bind(format!("{IP}:0")).await.unwrap();
        other.local_addr().unwrap()
    };
    let other_kind = MessageListener::bind(format!("{IP}:0")).await.unwrap();
    let other_kind_addr = other_kind.local_addr().unwrap();
    let no_device: SocketAddr = "127.0.0.1:7999".parse().unwrap();
    let cfg = RdmaConfig::new().connect_timeout(Duration::from_secs(30));
    let mut rss_warm = 0;
    let mut phases = Phases::start();
    for i in 0..n {
        if i == 100 {
            rss_warm = rss();
        }
        let e = RdmaStream::connect_with(closed, &cfg).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{i}: {e}");
        assert!(
            matches!(Error::from_io(&e), Some(Error::ConnectionRefused { addr }) if *addr == closed),
            "{i}: {e:?}"
        );
        let e = RdmaStream::connect_with(no_device, &cfg).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{i}: {e}");
        assert!(
            matches!(Error::from_io(&e), Some(Error::Unreachable { addr, .. }) if *addr == no_device),
            "{i}: {e:?}"
        );
        let e = RdmaStream::connect_with(other_kind_addr, &cfg)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{i}: {e}");
        assert!(
            matches!(
                Error::from_io(&e),
                Some(Error::HandshakeRejected {
                    reason: RejectReason::WrongKind,
                    ..
                })
            ),
            "{i}: {e:?}"
        );
        let e = RdmaListener::bind(in_use).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{i}: {e}");
    }
    phases.done(&format!("{n} rounds of four failures"));
    drop(other_kind);
    assert_back_to(start, fds, 2, SETTLE).await;
    let grew = rss().saturating_sub(rss_warm);
    assert!(
        grew < RSS_SLACK,
        "RSS grew by {grew} bytes over {} rounds of four failures",
        n - 100
    );
    drop(l);
}

/// [`failure_paths`] 1,000 times each (about 30 s in the TCG guest).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_paths_1000_times_each_are_typed_and_leave_nothing() {
    failure_paths(1000).await;
}

/// [`failure_paths`] 10,000 times each (several minutes in the TCG
/// guest): run by `TOKIO_RDMA_VOLUME=1 scripts/test`, not in CI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "volume run: TOKIO_RDMA_VOLUME=1 scripts/test"]
async fn volume_failure_paths_10000_times_each_are_typed_and_leave_nothing() {
    failure_paths(10_000).await;
}

/// Runs `bin args` as user `nobody` (root's CAP_IPC_LOCK would bypass the
/// limit) with RLIMIT_MEMLOCK at 64 KiB: less than one stream's ring plus
/// send buffer. Returns (exit success, stdout, stderr).
async fn run_with_small_memlock(bin: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new("prlimit")
        .arg("--memlock=65536:65536")
        .args([
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
        ])
        .arg(bin)
        .args(args)
        .output()
        .await
        .expect("prlimit and setpriv (util-linux) run in the guest");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A process that cannot pin one connection's memory gets the typed
/// resource error at connect, naming RLIMIT_MEMLOCK, its value and how to
/// raise it (not a failure at its first write); an `auto://` client in the
/// same situation falls back to TCP and its request succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_memlock_limit_is_a_typed_error_at_connect_and_auto_falls_back() {
    const PORT: u16 = 7813;
    let server = tokio::process::Command::new(example("migrate_tcp"))
        .args(["serve", &format!("auto://{IP}:{PORT}")])
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Up (as root, no limit) once an RDMA connect works.
    let addr: SocketAddr = format!("{IP}:{PORT}").parse().unwrap();
    let mut up = false;
    for _ in 0..1200 {
        if RdmaStream::connect(addr).await.is_ok() {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(up, "the auto:// server came up");

    let (ok, _, stderr) = run_with_small_memlock(
        &example("echo"),
        &["client", &addr.to_string(), "--bytes", "4096"],
    )
    .await;
    assert!(!ok, "an rdma connect under a 64 KiB memlock limit fails");
    assert!(
        stderr.contains("echo client: connect: ibv_reg_mr failed: locked memory (RLIMIT_MEMLOCK) exhausted (limit 65536 bytes)"),
        "{stderr}"
    );
    assert!(stderr.contains("ulimit -l"), "{stderr}");

    let target = format!("auto://{IP}:{PORT}");
    let (ok, stdout, stderr) = run_with_small_memlock(
        &example("migrate_tcp"),
        &["call", &target, "--size", "4096"],
    )
    .await;
    assert!(ok, "auto:// falls back to TCP: {stdout}{stderr}");
    assert!(
        stdout.starts_with(&format!("{target}: connected over tcp ")),
        "{stdout}"
    );
    assert!(stdout.contains("server says: served "), "{stdout}");
    drop(server);
}

/// Connections beyond a few cost no file descriptor: a server limited to
/// 64 (RLIMIT_NOFILE, where a socket server holds fewer than 64
/// connections; 4 of ours get a completion channel of their own, a
/// sixteenth of the limit) accepts 200 stream connections held open at
/// once, and while it holds them a new client gets its HTTP answer over
/// rdma://.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_64_descriptors_holds_200_connections() {
    const PORT: u16 = 7814;
    const NOFILE: usize = 64;
    const HELD: usize = 200;
    let mut server = tokio::process::Command::new("prlimit")
        .arg(format!("--nofile={NOFILE}:{NOFILE}"))
        .arg(example("migrate_tcp"))
        .args(["serve", &format!("rdma://{IP}:{PORT}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("prlimit (util-linux) runs in the guest");
    let mut log = server.stderr.take().unwrap();
    let log = tokio::spawn(async move {
        let mut text = String::new();
        let _ = log.read_to_string(&mut text).await;
        text
    });
    let addr: SocketAddr = format!("{IP}:{PORT}").parse().unwrap();
    let cfg = RdmaConfig::new().connect_timeout(CONNECT_TIMEOUT);
    let mut held = Vec::new();
    for _ in 0..1200 {
        if let Ok(s) = RdmaStream::connect_with(addr, &cfg).await {
            held.push(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(held.len(), 1, "the server came up");
    while held.len() < HELD {
        match RdmaStream::connect_with(addr, &cfg).await {
            Ok(s) => held.push(s),
            Err(e) => panic!("connection {} refused: {e:?}", held.len() + 1),
        }
    }
    assert_eq!(held.len(), HELD);
    let target = format!("rdma://{IP}:{PORT}");
    let out = tokio::process::Command::new(example("migrate_tcp"))
        .args(["call", &target, "--size", "4096"])
        .output()
        .await
        .unwrap();
    let answer = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{answer}");
    assert!(
        answer.starts_with(&format!("{target}: connected over rdma ")),
        "{answer}"
    );
    assert!(answer.contains("server says: served "), "{answer}");
    // Every held connection is alive: a FIN from each reaches the server,
    // whose HTTP handler closes its side; each read then sees end of file.
    let mut failed = Vec::new();
    for (i, mut s) in held.into_iter().enumerate() {
        let mut rest = Vec::new();
        match s.shutdown().await {
            Ok(()) => match s.read_to_end(&mut rest).await {
                Ok(n) => assert_eq!(n, 0, "held connection {i}"),
                Err(e) => failed.push(format!("held connection {i}: read: {e:?}")),
            },
            Err(e) => failed.push(format!("held connection {i}: shutdown: {e:?}")),
        }
    }
    server.kill().await.unwrap();
    let log = log.await.unwrap();
    assert!(failed.is_empty(), "{failed:?}\nserver log:\n{log}");
    assert!(!log.contains("RLIMIT_NOFILE"), "{log}");
}

/// 1,024 message endpoints (2,048 ends in this process, all on one pool)
/// connect at once; idle, each end keeps 15 receive buffers of 4 KiB posted
/// and nothing else registered: 60 KiB in use per end, at most 64 KiB
/// registered with the pool's slabs (4 MiB; a slab or two beyond what is in
/// use). Then each client sends 16 pipelined 4 KiB messages and gets them
/// echoed, bytes equal; closed, everything is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_message_endpoints_on_one_pool_pin_64_kib_each_when_idle() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio_rdma::pool::{MemoryPool, PoolConfig};
    use tokio_rdma::{MessageConfig, MessageEndpoint, MessageListener};
    const N: usize = 1024;
    const MESSAGES: u64 = 16;
    const LEN: usize = 4096;
    const PER_END: u64 = 15 * LEN as u64;
    const AT_MOST: u64 = 64 * 1024;
    let pool_for = |max: u64| {
        MemoryPool::for_device("rxe0", PoolConfig::new().max_registered_bytes(max))
            .expect("rxe0 in the guest")
    };
    // Warm-up on a pool of its own, so the device is open before counting.
    {
        let warm = MessageConfig::new().pool(pool_for(64 << 20));
        let l = MessageListener::bind_with(format!("{IP}:0"), &warm)
            .await
            .unwrap();
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(MessageEndpoint::connect_with(addr, &warm), l.accept());
        let (c, (s, _)) = (c.unwrap(), s.unwrap());
        c.send_copy(b"warm").await.unwrap();
        assert_eq!(&s.recv().await.unwrap().unwrap()[..], b"warm");
        drop((c, s, l));
    }
    let deadline = Instant::now() + SETTLE;
    while resources().queue_pairs != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (start, fds) = (resources(), open_fds());

    let pool = pool_for(1 << 30);
    let cfg = MessageConfig::new().pool(pool.clone()).connection(
        RdmaConfig::new()
            .connect_timeout(CONNECT_TIMEOUT)
            .share_completion_queue(true),
    );
    let l = MessageListener::bind_with(format!("{IP}:0"), &cfg)
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let server = {
        let accepted = Arc::clone(&accepted);
        tokio::spawn(async move {
            let mut echoes = JoinSet::new();
            for _ in 0..N {
                let (ep, _) = l.accept().await.unwrap();
                accepted.fetch_add(1, Ordering::SeqCst);
                echoes.spawn(async move {
                    let mut n = 0u64;
                    let r = async {
                        while let Some(m) = ep.recv().await? {
                            ep.send(m).await?;
                            n += 1;
                        }
                        ep.close().await
                    }
                    .await;
                    (n, r)
                });
            }
            let (mut echoed, mut failed) = (0, Vec::new());
            while let Some(r) = echoes.join_next().await {
                let (n, r) = r.unwrap();
                echoed += n;
                // Every end closes cleanly: the client's CLOSE arrives
                // before its disconnect, so this side's last CREDIT, still
                // in flight when the client's QP goes, is no failure.
                if let Err(e) = r {
                    failed.push(format!("after {n} echoes: {e:?}"));
                }
            }
            (l, echoed, failed)
        })
    };
    let mut connects = JoinSet::new();
    for _ in 0..N {
        let cfg = cfg.clone();
        connects.spawn(async move { MessageEndpoint::connect_with(addr, &cfg).await });
    }
    let mut clients = Vec::with_capacity(N);
    while let Some(r) = connects.join_next().await {
        clients.push(r.unwrap().expect("connect"));
    }
    let deadline = Instant::now() + SETTLE;
    while accepted.load(Ordering::SeqCst) < N && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(accepted.load(Ordering::SeqCst), N);

    // Idle: 15 buffers of 4 KiB per end, and nothing else registered.
    for c in &clients {
        assert_eq!(c.stats().recv_buffers_posted, 15);
    }
    let ends = 2 * N as u64;
    let p = pool.stats();
    assert_eq!(p.bytes_in_use, ends * PER_END, "{p:?}");
    let now = resources();
    assert_eq!(now.queue_pairs - start.queue_pairs, ends);
    // 16,384 / (180 send WRs (128, 2 per rendezvous in flight, 4, 32
    // remote-memory slots) + 128 receive WRs + 16).
    assert_cqs(start, now, 0, ends, 50);
    // Every registration of these endpoints is the pool's.
    let registered = without_cache(now).4 - without_cache(start).4;
    assert_eq!(registered, p.bytes_registered, "{now:?} {p:?}");
    assert!(
        registered <= ends * AT_MOST,
        "{} registered bytes per end: {p:?}",
        registered / ends
    );

    // Busy: 16 pipelined 4 KiB messages each way per endpoint.
    let mut echoes = JoinSet::new();
    for (seed, ep) in clients.into_iter().enumerate() {
        let seed = seed as u64;
        echoes.spawn(async move {
            let mut buf = vec![0u8; LEN];
            for m in 0..MESSAGES {
                for (k, b) in buf.iter_mut().enumerate() {
                    *b = pattern(seed, m * LEN as u64 + k as u64);
                }
                ep.send_copy(&buf).await?;
            }
            for m in 0..MESSAGES {
                let back = ep.recv().await?.ok_or_else(|| {
                    io::Error::other(format!(
                        "endpoint {seed}: the peer closed before echo {m}: {:?}",
                        ep.stats()
                    ))
                })?;
                assert_eq!(back.len(), LEN);
                for (k, &b) in back.iter().enumerate() {
                    assert_eq!(
                        b,
                        pattern(seed, m * LEN as u64 + k as u64),
                        "endpoint {seed}, message {m}, byte {k}"
                    );
                }
            }
            ep.close().await?;
            Ok::<_, io::Error>(())
        });
    }
    let mut failed = Vec::new();
    while let Some(r) = echoes.join_next().await {
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed.push(format!("{e:?}")),
            Err(e) => failed.push(format!("panic: {e:?}")),
        }
    }
    let (l, echoed, server_failed) = server.await.unwrap();
    assert!(
        failed.is_empty() && server_failed.is_empty(),
        "{} clients failed: {:?}; {} server ends failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)],
        server_failed.len(),
        &server_failed[..server_failed.len().min(5)]
    );
    assert_eq!(echoed, N as u64 * MESSAGES);
    drop((l, cfg, pool));
    assert_back_to(start, fds, 2, SETTLE).await;
}
