//! Guest tests of a link and a device that change under running
//! connections (rxe0 on veth0): the netdev down and up, idle and under
//! traffic. Needs the guest, as root (it changes veth0); fails, never
//! skips, without it.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it).
#![cfg(tokio_rdma_guest)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio_rdma::{Error, RdmaConfig, RdmaListener, RdmaStream};

mod common;

#[path = "../examples/shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

/// The netdev rxe0 is bound to (integration/softroce).
const NETDEV: &str = "veth0";

fn run(cmd: &str, args: &[&str]) {
    let status = std::process::Command::new(cmd)
        .args(args)
        .status()
        .expect("run");
    assert!(status.success(), "{cmd} {args:?}: {status}");
}

fn addr() -> SocketAddr {
    "10.11.0.1:0".parse().unwrap()
}

/// Keepalive short enough that a peer lost without a word is found in
/// seconds (the default is 30 s).
fn config() -> RdmaConfig {
    RdmaConfig::default().keepalive(Some(Duration::from_secs(2)))
}

/// Whether the device's port 1 is active now (`ibv_query_port`).
fn port_active() -> bool {
    tokio_rdma::verbs::devices()
        .expect("devices")
        .iter()
        .filter(|d| d.name == common::device())
        .flat_map(|d| &d.ports)
        .any(|p| p.state == tokio_rdma::verbs::PortState::Active)
}

/// Waits (up to 20 s) until the port is active and a stream connects
/// and echoes; returns how many connects failed before.
async fn wait_usable() -> u32 {
    let t0 = Instant::now();
    let mut failed = 0;
    loop {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the device is not usable 20 s after the change"
        );
        if port_active() {
            match tokio::time::timeout(Duration::from_secs(5), echo_once()).await {
                Ok(Ok(())) => return failed,
                Ok(Err(e)) => println!("connect after the change: {e:?}"),
                Err(_) => println!("connect after the change: timed out"),
            }
            failed += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A new listener and a new stream in this process: 64 KiB echoed exact.
async fn echo_once() -> std::io::Result<()> {
    let l = RdmaListener::bind_with(addr(), &config()).await?;
    let at = l.local_addr()?;
    let accept = tokio::spawn(async move { l.accept().await.map(|(s, _)| s) });
    let c = RdmaStream::connect_with(at, &config()).await;
    let c = match c {
        Ok(c) => c,
        Err(e) => {
            accept.abort();
            return Err(e);
        }
    };
    let s = accept.await.expect("accept task")?;
    tokio::spawn(common::echo(s));
    let (tx, stop) = tokio::sync::watch::channel(false);
    let t = tokio::spawn(traffic(c, 99, stop));
    tokio::time::sleep(Duration::from_millis(50)).await;
    tx.send(true).unwrap();
    let n = t.await.expect("traffic task").map_err(|(e, _)| e)?;
    assert!(n > 0);
    Ok(())
}

/// One connection's traffic: 16 KiB blocks of a pattern echoed exact
/// until `stop` ([`common::echo_blocks_until`]).
async fn traffic(
    c: RdmaStream,
    seed: u8,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<u64, (std::io::Error, Instant)> {
    common::echo_blocks_until(c, shared::pattern_vec(seed.into(), 16 * 1024), stop).await
}

/// `n` streams to a listener of this process, each served by an echo task.
async fn connections(n: usize) -> (RdmaListener, Vec<RdmaStream>) {
    let l = RdmaListener::bind_with(addr(), &config())
        .await
        .expect("bind");
    let at = l.local_addr().unwrap();
    let mut out = Vec::new();
    let cfg = config();
    for _ in 0..n {
        let (c, s) = tokio::time::timeout(Duration::from_secs(15), async {
            tokio::join!(RdmaStream::connect_with(at, &cfg), l.accept())
        })
        .await
        .expect("connect and accept within 15 s");
        out.push(c.expect("connect"));
        tokio::spawn(common::echo(s.expect("accept").0));
    }
    (l, out)
}

/// Traffic tasks on `n` streams (stopped by the sender), started 300 ms
/// ago.
type TrafficTask = tokio::task::JoinHandle<Result<u64, (std::io::Error, Instant)>>;

async fn under_traffic(
    n: usize,
) -> (
    RdmaListener,
    tokio::sync::watch::Sender<bool>,
    Vec<TrafficTask>,
) {
    let (l, conns) = connections(n).await;
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let tasks = conns
        .into_iter()
        .enumerate()
        .map(|(i, c)| tokio::spawn(traffic(c, i as u8, stop.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    (l, stop_tx, tasks)
}

/// `e` is `Error::DeviceRemoved`, kind `ConnectionAborted`.
fn assert_device_removed(e: &std::io::Error) {
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionAborted, "{e:?}");
    assert!(
        matches!(
            e.get_ref().and_then(|e| e.downcast_ref::<Error>()),
            Some(Error::DeviceRemoved)
        ),
        "{e:?}"
    );
}

/// The netdev down for `down`, then up; returns when `ip` set it up.
fn link_down_for(down: Duration) {
    run("ip", &["link", "set", NETDEV, "down"]);
    std::thread::sleep(down);
    run("ip", &["link", "set", NETDEV, "up"]);
}

/// 32 idle streams ride out the netdev down for 200 ms: each echoes
/// exact afterwards and ends with EOF; the port's state changes are
/// counted in `stats::ports`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_ride_out_a_short_link_down() {
    let (_l, conns) = connections(32).await;
    let before = port_changes();
    tokio::task::spawn_blocking(|| link_down_for(Duration::from_millis(200)))
        .await
        .unwrap();
    let failed = wait_usable().await;
    println!("connects failed before the device was usable again: {failed}");
    // PORT_ERR, then PORT_ACTIVE (rxe reports the port active once for
    // the netdev's carrier and once more for its operational state).
    let ports = tokio_rdma::stats::ports();
    let p1 = ports.iter().find(|p| p.port == 1).expect("port 1 listed");
    assert!(p1.active, "{p1:?}");
    assert!(p1.changes >= before + 2, "{p1:?}, {before} before");
    let (_tx, stop) = tokio::sync::watch::channel(true);
    for (i, c) in conns.into_iter().enumerate() {
        let r = traffic(c, i as u8, stop.clone()).await.map_err(|e| e.0);
        assert_eq!(r.expect("an idle stream rides it out"), 16 * 1024);
    }
}

/// Port 1's state changes counted so far (0 before any).
fn port_changes() -> u64 {
    tokio_rdma::stats::ports()
        .iter()
        .find(|p| p.port == 1 && p.device == common::device())
        .map_or(0, |p| p.changes)
}

/// The netdev down for 10 s under 32 idle streams: each fails with
/// `PortDown` once the port stayed down for the RC retry bound, every
/// close returns, and once the link is up a new listener and stream in
/// the same process work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_down_past_the_retry_bound_fails_each_connection_with_port_down() {
    // The device opened (its PD and context are kept for the process),
    // and the probe's connection closed.
    wait_usable().await;
    let t = Instant::now();
    while tokio_rdma::stats::resources().queue_pairs + tokio_rdma::stats::resources().cm_ids > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the probe connection closes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let start = tokio_rdma::stats::resources();
    let fds = common::open_fds();
    let (l, conns) = connections(32).await;
    let at = l.local_addr().unwrap();
    let bound = RdmaConfig::default().retry_bound();
    let t0 = Instant::now();
    let down = tokio::task::spawn_blocking(|| link_down_for(Duration::from_secs(10)));
    for mut c in conns {
        let mut buf = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(8), c.read(&mut buf))
            .await
            .expect("the read fails while the link is still down");
        let e = r.expect_err("no byte and no EOF");
        assert_eq!(e.kind(), std::io::ErrorKind::NetworkDown, "{e:?}");
        match e.get_ref().and_then(|e| e.downcast_ref::<Error>()) {
            Some(Error::PortDown {
                device,
                port: 1,
                after,
            }) => {
                assert_eq!(*device, common::device());
                assert!(*after >= bound, "failed after {after:?}, bound {bound:?}");
            }
            other => panic!("expected PortDown, got {other:?}"),
        }
        // Closing returns at once.
        tokio::time::timeout(Duration::from_secs(2), async { drop(c) })
            .await
            .expect("drop returns");
    }
    // A connect while the port is down fails at once, typed.
    let e = RdmaStream::connect_with(at, &config())
        .await
        .expect_err("the port is down");
    assert_eq!(e.kind(), std::io::ErrorKind::NetworkDown, "{e:?}");
    assert!(
        !down.is_finished(),
        "the link came back before the checks: {:?}",
        t0.elapsed()
    );
    let ports = tokio_rdma::stats::ports();
    let p1 = ports.iter().find(|p| p.port == 1).expect("port 1 listed");
    assert!(!p1.active, "{p1:?}");
    down.await.unwrap();
    drop(l);
    let failed = wait_usable().await;
    println!("connects failed before the device was usable again: {failed}");
    // Every id kept while the port was down is gone once it is back.
    common::assert_back_to(start, fds, 4, Duration::from_secs(20)).await;
}

/// Streams under traffic when the netdev goes down for 200 ms: each one
/// either echoes exact to its end or fails with a typed error, and none
/// hangs. Afterwards new connections work, at once or, where Soft-RoCE's
/// GSI QP died of a kernel reply sent while the link was down (see the
/// README), once the device is re-created, which this process survives:
/// the crate notices the removal without any connection on the device
/// (its uverbs entry leaves sysfs) and lets go of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_under_traffic_across_a_short_link_down_end_exact_or_typed() {
    let (l, stop_tx, tasks) = under_traffic(32).await;
    let t0 = Instant::now();
    tokio::task::spawn_blocking(|| link_down_for(Duration::from_millis(200)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_tx.send_replace(true);
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        // Keepalive (2 s) bounds how long a stream whose peer failed
        // without a word can wait.
        match tokio::time::timeout(Duration::from_secs(20), t).await {
            Ok(Ok(Ok(n))) => {
                assert!(n >= 16 * 1024);
                ok += 1;
            }
            Ok(Ok(Err((e, at)))) => {
                println!("{e:?} after {:?}", at - t0);
                assert!(
                    matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::NetworkDown
                            | std::io::ErrorKind::TimedOut
                    ),
                    "{e:?}"
                );
                assert!(e.get_ref().is_some_and(|e| e.is::<Error>()), "typed: {e:?}");
                failed += 1;
            }
            Ok(Err(e)) => panic!("traffic task: {e}"),
            Err(_) => panic!("a stream hangs {:?} after the link went down", t0.elapsed()),
        }
    }
    println!("{ok} streams ended exact, {failed} failed typed");
    assert_eq!(ok + failed, 32);
    drop(l);
    if usable_within(Duration::from_secs(8)).await {
        return;
    }
    println!("no connection on the device after the flap: re-creating it");
    let _restore = Restore;
    run(
        "rdma",
        &["link", "add", "rxe1", "type", "rxe", "netdev", "veth1"],
    );
    let del = rdma_link(vec!["delete".into(), common::device()]);
    wait_deleted(del, 30).await;
    assert!(add_device().success(), "rdma link add");
    let failed = wait_usable().await;
    println!("connects failed before the re-created device was usable: {failed}");
}

/// Whether a new listener and stream work within `limit`.
async fn usable_within(limit: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if port_active() {
            let left = limit.saturating_sub(t0.elapsed());
            match tokio::time::timeout(left, echo_once()).await {
                Ok(Ok(())) => return true,
                Ok(Err(e)) => println!("connect after the change: {e:?}"),
                Err(_) => println!("connect after the change: timed out"),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

/// Asks librdmacm to re-read the device list (it closes its context of a
/// device gone, with no id on it, while another device is present).
fn resync_rdma_cm() {
    let mut n = 0;
    // SAFETY: `n` is writable; the list is freed once.
    unsafe {
        let list = rdma_mummy_sys::rdma_get_devices(&mut n);
        if !list.is_null() {
            rdma_mummy_sys::rdma_free_devices(list);
        }
    }
}

/// Runs `rdma link ARGS` on a thread; `Some(status)` once it returned.
fn rdma_link(args: Vec<String>) -> std::thread::JoinHandle<std::process::ExitStatus> {
    std::thread::spawn(move || {
        std::process::Command::new("rdma")
            .arg("link")
            .args(&args)
            .status()
            .expect("run rdma")
    })
}

/// `rdma link add` of the guest's device (rxe on veth0).
fn add_device() -> std::process::ExitStatus {
    std::process::Command::new("rdma")
        .args([
            "link",
            "add",
            &common::device(),
            "type",
            "rxe",
            "netdev",
            NETDEV,
        ])
        .status()
        .expect("run rdma")
}

/// Whether an RDMA device `name` exists (sysfs).
fn device_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/infiniband")
        .join(name)
        .exists()
}

/// Waits (up to `secs`) for `del` to return; asserts it succeeded.
async fn wait_deleted(del: std::thread::JoinHandle<std::process::ExitStatus>, secs: u64) {
    let t = Instant::now();
    while !del.is_finished() {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "rdma link delete still waits after {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(del.join().unwrap().success(), "rdma link delete failed");
}

/// Puts the guest's devices back whatever the test did: rxe0 on veth0,
/// no second device.
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        if !device_exists(&common::device()) {
            let _ = add_device();
        }
        if device_exists("rxe1") {
            // librdmacm opened rxe1 too (`rdma_get_devices` opens every
            // device): have it re-read the list so it closes it.
            let del = rdma_link(vec!["delete".into(), "rxe1".into()]);
            let t = Instant::now();
            while !del.is_finished() && t.elapsed() < Duration::from_secs(30) {
                resync_rdma_cm();
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// `rdma link delete` of the device under 4 streams with traffic and a
/// listener: each stream fails with `DeviceRemoved`, so does `accept`; the
/// crate lets go of the device and the delete completes (a second device,
/// rxe1 on veth1, is present: librdmacm releases a removed device only
/// then); a connect while it is gone fails typed; after `rdma link add`,
/// a new listener and stream in the same process work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zz_a_device_deleted_and_added_back_fails_typed_and_works_again() {
    let dev = common::device();
    let _restore = Restore;
    run(
        "rdma",
        &["link", "add", "rxe1", "type", "rxe", "netdev", "veth1"],
    );
    let (l, _stop_tx, tasks) = under_traffic(4).await;
    let at = l.local_addr().unwrap();
    let t0 = Instant::now();
    let del = rdma_link(vec!["delete".into(), dev.clone()]);
    for t in tasks {
        let (e, when) = tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("a stream ends")
            .expect("traffic task")
            .expect_err("the device went");
        println!("{e:?} after {:?}", when - t0);
        assert_device_removed(&e);
    }
    let e = tokio::time::timeout(Duration::from_secs(10), l.accept())
        .await
        .expect("accept returns")
        .expect_err("the device went");
    assert_device_removed(&e);
    drop(l);
    // The delete completes: the crate let go of the device, and its watch
    // thread had librdmacm close its own context.
    wait_deleted(del, 30).await;
    println!("deleted after {:?}", t0.elapsed());
    // Nothing of the device is left; the one shared channel is the
    // process's rdma_cm channel, which belongs to no device.
    let r = tokio_rdma::stats::resources();
    assert_eq!(
        (
            r.queue_pairs,
            r.completion_queues,
            r.memory_regions,
            r.cm_ids,
            r.protection_domains,
            r.shared_event_channels
        ),
        (0, 0, 0, 0, 0, 1),
        "{r:?}"
    );
    let e = RdmaStream::connect_with(at, &config())
        .await
        .expect_err("no device");
    println!("connect while deleted: {e:?}");
    assert!(e.get_ref().is_some_and(|e| e.is::<Error>()), "typed: {e:?}");
    assert!(add_device().success(), "rdma link add");
    let failed = wait_usable().await;
    println!("connects failed before the device was usable again: {failed}");
}
