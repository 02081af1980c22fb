//! Helpers the guest tests share: example binaries to run as peer processes,
//! signals to stop, resume or kill them, a connect retry and a stream echo.
#![allow(dead_code)]

#[path = "../../examples/shared/echo.rs"]
mod echo_loop;
// Not every test binary uses it.
#[allow(unused_imports)]
pub use echo_loop::echo;

/// The soft RDMA device the guest runs on: `TOKIO_RDMA_TEST_DEVICE`, which
/// `integration/softroce` sets (`rxe0` for Soft-RoCE, `siw0` with
/// `--provider siw`); `rxe0` when unset.
pub fn device() -> String {
    std::env::var("TOKIO_RDMA_TEST_DEVICE").unwrap_or_else(|_| "rxe0".to_string())
}

/// Whether the guest's device ([`device`]) speaks iWARP (no immediate
/// data, no memory windows, no atomics on siw), as
/// `tokio_rdma::verbs::device` reports its transport.
pub fn iwarp() -> bool {
    let name = device();
    let dev = tokio_rdma::verbs::device::devices()
        .expect("the RDMA devices")
        .into_iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("device {name} in the guest"));
    dev.transport == tokio_rdma::verbs::device::RdmaTransport::Iwarp
}

/// The path of an example binary (`cargo test` builds them beside the
/// test binaries).
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        bin.exists(),
        "{} must be built (cargo test builds examples)",
        bin.display()
    );
    bin
}

/// Sends `sig` (`STOP`, `CONT`) to `child` with `kill(1)`.
pub fn signal(child: &tokio::process::Child, sig: &str) {
    let pid = child.id().expect("the child is running").to_string();
    let st = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}

/// Retries `attempt` every 100 ms until it succeeds or `tries` attempts
/// failed (a peer process or guest that is still starting); panics with the
/// last error then.
pub async fn retry<T, E, F, Fut>(tries: u32, mut attempt: F) -> T
where
    E: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut last = None;
    for _ in 0..tries {
        match attempt().await {
            Ok(v) => return v,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the peer did not come up: {last:?}");
}

/// File descriptors this process has open now.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// The counts that must return to the start once connections are gone:
/// everything but the device's cache of idle send buffers (kept for reuse,
/// at most 4 MiB), whose regions and bytes are taken out.
pub fn without_cache(
    r: tokio_rdma::stats::ResourceSnapshot,
) -> (u64, u64, u64, u64, u64, u64, u64, u64, u64) {
    (
        r.queue_pairs,
        r.completion_queues,
        r.completion_channels,
        r.memory_regions - r.idle_send_buffers,
        r.registered_bytes - r.idle_send_buffer_bytes,
        r.memory_windows,
        r.protection_domains,
        r.cm_ids,
        r.cm_event_channels,
    )
}

/// Waits (up to `settle`, a liveness bound) until the resources and fds
/// are back at `start` (fds within `fd_slack`), then asserts it.
pub async fn assert_back_to(
    start: tokio_rdma::stats::ResourceSnapshot,
    fds: usize,
    fd_slack: usize,
    settle: std::time::Duration,
) {
    use tokio_rdma::stats::resources;
    let deadline = std::time::Instant::now() + settle;
    loop {
        let now = resources();
        let back =
            without_cache(now) == without_cache(start) && open_fds().abs_diff(fds) <= fd_slack;
        if back || std::time::Instant::now() > deadline {
            assert_eq!(
                without_cache(now),
                without_cache(start),
                "{now:?} vs {start:?}"
            );
            assert!(
                open_fds().abs_diff(fds) <= fd_slack,
                "fds {} vs {fds} at the start",
                open_fds()
            );
            assert!(now.idle_send_buffers <= 64, "{now:?}");
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Prints how long each phase of a long test took (`phase NAME: 12.3 s`), so a
/// CI log says which part of a test costs the time. Prints only; no test
/// asserts a duration.
pub struct Phases {
    last: std::time::Instant,
}

impl Phases {
    /// Starts timing the first phase.
    pub fn start() -> Self {
        Self {
            last: std::time::Instant::now(),
        }
    }

    /// Ends the current phase as `name` and starts the next.
    pub fn done(&mut self, name: &str) {
        let now = std::time::Instant::now();
        println!("phase {name}: {:.1} s", (now - self.last).as_secs_f64());
        self.last = now;
    }
}

/// A connected pair of message endpoints in this process, on a listener
/// bound to `ip` port 0 with `cfg` at both ends: (client, server).
pub async fn message_pair(
    ip: &str,
    cfg: &tokio_rdma::MessageConfig,
) -> (tokio_rdma::MessageEndpoint, tokio_rdma::MessageEndpoint) {
    let listener = tokio_rdma::MessageListener::bind_with(format!("{ip}:0"), cfg)
        .await
        .expect("bind on the RDMA device's address");
    let addr = listener.local_addr().unwrap();
    let (c, s) = tokio::join!(
        tokio_rdma::MessageEndpoint::connect_with(addr, cfg),
        listener.accept()
    );
    (c.expect("connect"), s.expect("accept").0)
}

/// Writes `block` and reads its echo back exact, again and again until
/// `stop` is set, then shuts down and reads EOF (nothing after the echo);
/// returns the bytes echoed, or the first error and when it came.
pub async fn echo_blocks_until(
    mut s: tokio_rdma::RdmaStream,
    block: Vec<u8>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<u64, (std::io::Error, std::time::Instant)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut back = vec![0u8; block.len()];
    let mut total = 0u64;
    let at = |e| (e, std::time::Instant::now());
    loop {
        let (mut r, mut w) = s.split();
        let (a, b) = tokio::join!(w.write_all(&block), r.read_exact(&mut back));
        a.map_err(at)?;
        b.map_err(at)?;
        assert!(back == block, "echo exact");
        total += block.len() as u64;
        if *stop.borrow() {
            break;
        }
    }
    s.shutdown().await.map_err(at)?;
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).await.map_err(at)?;
    assert!(rest.is_empty(), "nothing after the echo");
    Ok(total)
}

/// Waits until every connection of this process has finished in the
/// background (its driver delivered what was accepted, then freed its QP),
/// at most `bound`. A process or server role returns only then: returning
/// shuts the test's runtime down, and background delivery (linger) runs on
/// that runtime, so the peer would read `ConnectionReset` instead of the
/// last bytes and EOF (the guide's TCP parity page).
pub async fn background_delivery_done(bound: std::time::Duration) {
    let deadline = tokio::time::Instant::now() + bound;
    while tokio_rdma::stats::resources().queue_pairs > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "connections still delivering after {bound:?}: {:?}",
            tokio_rdma::stats::resources()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
