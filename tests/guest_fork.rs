//! Guest tests of a process that forks while it has registered memory and
//! live connections on rxe0 (needs the Soft-RoCE guest:
//! `integration/softroce run -- ...`). Fails, never skips, without a
//! device.
//!
//! Since Linux 5.13 a fork copies, for the child, every anonymous page
//! that is pinned for DMA (a registered MR) instead of sharing it
//! copy-on-write, so the parent keeps the very pages the NIC maps whatever
//! the child writes, and no `ibv_fork_init`/`RDMAV_FORK_SAFE` is needed
//! (rdma-core then reports fork as safe without them). These tests hold
//! the crate to that on Debian 12's kernel.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it).
#![cfg(tokio_rdma_guest)]

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rdma::remote::{GrantAccess, LocalRegion};
use tokio_rdma::{Error, MessageConfig, RdmaListener, RdmaStream};

mod common;

#[path = "../examples/shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

const IP: &str = "10.11.0.1";
const MIB: usize = 1024 * 1024;

async fn stream_pair() -> (RdmaStream, RdmaStream) {
    let l = RdmaListener::bind(format!("{IP}:0")).await.expect("bind");
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(RdmaStream::connect(addr), l.accept());
    (c.expect("connect"), s.expect("accept").0)
}

/// Echoes `len` bytes of pattern `seed` through `client` (its peer echoes
/// them back) in 64 KiB writes; returns the bytes that came back equal.
async fn echo_pattern(client: &mut RdmaStream, seed: u64, len: usize) -> usize {
    let data = shared::pattern_vec(seed, len);
    let (mut r, mut w) = client.split();
    let write = async {
        for chunk in data.chunks(64 * 1024) {
            w.write_all(chunk).await.expect("write");
        }
    };
    let read = async {
        let mut back = vec![0u8; len];
        r.read_exact(&mut back).await.expect("read the echo");
        back.iter().zip(&data).take_while(|(a, b)| a == b).count()
    };
    tokio::join!(write, read).1
}

/// Waits (off the runtime) for forked child `pid`; its exit code, after
/// checking it exited rather than died.
async fn exit_code(pid: libc::pid_t) -> i32 {
    let (got, status) = tokio::task::spawn_blocking(move || {
        let mut status = 0;
        // SAFETY: waits for our own child; `status` is a valid out-pointer.
        let got = unsafe { libc::waitpid(pid, &mut status, 0) };
        (got, status)
    })
    .await
    .expect("waitpid task");
    assert_eq!(got, pid);
    assert!(libc::WIFEXITED(status), "the child exited: {status:#x}");
    libc::WEXITSTATUS(status)
}

/// Half-closes `client`, reads to the echo's EOF, and checks the echo
/// task moved `total` bytes.
async fn finish_echo(
    mut client: RdmaStream,
    echo: tokio::task::JoinHandle<std::io::Result<u64>>,
    total: usize,
) {
    client.shutdown().await.expect("shutdown");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), client.read_to_end(&mut rest))
        .await
        .expect("EOF in time")
        .expect("EOF");
    assert_eq!(echo.await.expect("echo task").expect("echo"), total as u64);
}

/// Children started with `std::process::Command` and
/// `tokio::process::Command` (fork and exec) while a stream echoes 16 MiB
/// and a message endpoint moves 64 rendezvous messages of 64 KiB: every
/// child exits 0, every byte comes back equal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_spawned_during_traffic_leave_connections_intact() {
    let (mut client, server) = stream_pair().await;
    let echo = tokio::spawn(common::echo(server));
    let (a, b) = common::message_pair(IP, &MessageConfig::new()).await;
    let children = tokio::spawn(async {
        let mut ok = 0u32;
        for i in 0..40 {
            let status = if i % 2 == 0 {
                tokio::task::spawn_blocking(|| std::process::Command::new("true").status())
                    .await
                    .expect("spawn_blocking")
            } else {
                tokio::process::Command::new("true").status().await
            };
            if status.expect("start a child").success() {
                ok += 1;
            }
        }
        ok
    });
    let messages = async {
        for i in 0..64u64 {
            let mut buf = a.pool().alloc_any(64 * 1024).await.expect("pool buffer");
            bytes::BufMut::put_slice(&mut buf, &shared::pattern_vec(i, 64 * 1024));
            a.send(buf).await.expect("send");
            let got = b.recv().await.expect("recv").expect("a message");
            assert_eq!(
                &got[..],
                &shared::pattern_vec(i, 64 * 1024)[..],
                "message {i}"
            );
        }
    };
    let (equal, (), ok) = tokio::join!(echo_pattern(&mut client, 7, 16 * MIB), messages, children);
    assert_eq!(
        equal,
        16 * MIB,
        "echoed bytes equal before the first difference"
    );
    assert_eq!(ok.expect("children task"), 40);
    client.shutdown().await.expect("shutdown");
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).await.expect("EOF");
    assert!(rest.is_empty());
    assert_eq!(
        echo.await.expect("echo task").expect("echo"),
        (16 * MIB) as u64
    );
}

/// A bare `fork()` whose child overwrites a granted region's pages and
/// other heap pages, then exits: the peer's one-sided READ of the region
/// still returns the parent's bytes, a write by the parent after the fork
/// is what the NIC reads next (the NIC maps the parent's pages, not
/// copies that went to the child), and the stream keeps echoing exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forked_child_writing_registered_pages_leaves_the_parents_intact() {
    let (mut client, server) = stream_pair().await;
    let echo = tokio::spawn(common::echo(server));
    assert_eq!(echo_pattern(&mut client, 1, MIB).await, MIB);

    let (owner, user) = common::message_pair(IP, &MessageConfig::new()).await;
    let region = LocalRegion::new(owner.pool().alloc_any(MIB).await.expect("pool buffer"));
    region
        .write_at(0, &shared::pattern_vec(2, region.len()))
        .unwrap();
    let grant = owner
        .grant(&region, 0..MIB, GrantAccess::READ)
        .await
        .expect("grant");
    let remote = grant.remote();
    assert_eq!(
        &user.read(&remote, 0, MIB).await.expect("READ")[..],
        &shared::pattern_vec(2, MIB)[..]
    );

    let mut heap = vec![0u8; 4 * MIB];
    let heap_ptr = heap.as_mut_ptr();
    let region_ptr = region.addr() as *mut u8;
    let region_len = region.len();
    // SAFETY: the child only stores bytes through pointers to memory that
    // was mapped and writable in the parent when it forked (its own copy
    // of the heap block and of the region's pages), calls nothing that
    // allocates or locks, and leaves with `_exit`, as a forked child of a
    // multi-threaded process must.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: see above; both ranges are within their allocations.
        unsafe {
            std::ptr::write_bytes(heap_ptr, 0xA5, 4 * MIB);
            std::ptr::write_bytes(region_ptr, 0x5A, region_len);
            libc::_exit(0);
        }
    }
    assert_eq!(exit_code(pid).await, 0);
    assert!(
        heap.iter().all(|&b| b == 0),
        "the child's writes stayed in the child"
    );
    drop(heap);

    assert_eq!(
        &user.read(&remote, 0, MIB).await.expect("READ after fork")[..],
        &shared::pattern_vec(2, MIB)[..],
        "the NIC still reads the parent's bytes"
    );
    region
        .write_at(0, &shared::pattern_vec(3, region.len()))
        .unwrap();
    assert_eq!(
        &user
            .read(&remote, 0, MIB)
            .await
            .expect("READ of the new bytes")[..],
        &shared::pattern_vec(3, MIB)[..],
        "a write by the parent after the fork reaches the pages the NIC maps"
    );
    assert_eq!(echo_pattern(&mut client, 4, 4 * MIB).await, 4 * MIB);

    grant.revoke().await.expect("revoke");
    finish_echo(client, echo, 5 * MIB).await;
}

/// Polls `fut` once (a forked child has no runtime): an inherited
/// resource's operation must be refused before it waits for anything.
fn poll_once<F: std::future::Future>(fut: F) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::pin!(fut).poll(&mut cx)
}

/// Whether `r` is ready with `Error::InheritedAfterFork` naming `parent`.
fn refused<T>(r: std::task::Poll<std::io::Result<T>>, parent: u32) -> bool {
    match r {
        std::task::Poll::Ready(Err(e)) => {
            e.kind() == std::io::ErrorKind::Unsupported
                && matches!(
                    Error::from_io(&e),
                    Some(Error::InheritedAfterFork { parent: p, .. }) if *p == parent
                )
        }
        _ => false,
    }
}

/// A forked child that tries every kind of operation on endpoints,
/// streams, grants and pools it inherited gets `InheritedAfterFork`
/// (naming the parent) from each, at once; then it drops all of them, a
/// registered region and its pool included, whose last references it
/// holds. The parent's objects are untouched: the region the child
/// dropped is still registered (a new grant on it binds and the peer
/// reads its bytes), the endpoints and the stream carry on exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forked_child_is_refused_inherited_endpoints_and_its_drops_leave_the_parents() {
    let (mut client, server) = stream_pair().await;
    let addr = client.peer_addr().unwrap();
    let echo = tokio::spawn(common::echo(server));
    assert_eq!(echo_pattern(&mut client, 1, MIB).await, MIB);
    let (owner, user) = common::message_pair(IP, &MessageConfig::new()).await;
    let pooled = LocalRegion::new(owner.pool().alloc_any(4096).await.unwrap());
    let grant = owner
        .grant(&pooled, 0..4096, GrantAccess::READ)
        .await
        .expect("grant");
    let remote = grant.remote();
    let pool = owner.pool().clone();
    let mine = pool
        .register_local(shared::pattern_vec(5, 64 * 1024))
        .expect("register");
    let mine_addr = mine.addr();

    let parent = std::process::id();
    // SAFETY: the child calls only the crate's refusals (an atomic load,
    // then an error's allocation: glibc's malloc is usable in a forked
    // child) and drops, and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = (|| {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let checks = [
                refused(poll_once(user.send_copy(b"from the child")), parent),
                refused(poll_once(owner.recv()), parent),
                refused(poll_once(user.read(&remote, 0, 8)), parent),
                refused(poll_once(user.write(&remote, 0, b"x")), parent),
                refused(
                    poll_once(owner.grant(&mine, 0..8, GrantAccess::READ)),
                    parent,
                ),
                refused(
                    std::pin::Pin::new(&mut client).poll_write(&mut cx, b"from the child"),
                    parent,
                ),
                refused(poll_once(RdmaStream::connect(addr)), parent),
                refused(poll_once(RdmaListener::bind(format!("{IP}:0"))), parent),
                refused(poll_once(grant.revoke()), parent),
                matches!(
                    pool.register_local(vec![1u8; 4096]),
                    Err(tokio_rdma::pool::PoolError::Registration { .. })
                ),
            ];
            if let Some(i) = checks.iter().position(|ok| !ok) {
                return 10 + i as i32;
            }
            drop(mine);
            drop(pool);
            drop(pooled);
            drop(client);
            drop(owner);
            drop(user);
            0
        })();
        // SAFETY: leaves the child without running the parent's exit
        // handlers or destructors.
        unsafe { libc::_exit(code) };
    }
    assert_eq!(
        exit_code(pid).await,
        0,
        "the first refusal that failed is 10 + its index"
    );

    // The region the child dropped is still the parent's, registered.
    assert_eq!(mine.addr(), mine_addr);
    let g = owner
        .grant(&mine, 100..200, GrantAccess::READ)
        .await
        .expect("grant on the region the child dropped");
    assert_eq!(
        &user.read(&g.remote(), 0, 100).await.expect("READ")[..],
        &shared::pattern_vec(5, 64 * 1024)[100..200]
    );
    g.revoke().await.expect("revoke");
    // The grant the child tried to revoke still opens its bytes.
    assert_eq!(user.read(&remote, 0, 8).await.expect("READ").len(), 8);
    // Messages both ways, and the stream, exactly as before.
    user.send_copy(b"after the fork").await.expect("send");
    assert_eq!(
        &owner.recv().await.expect("recv").expect("a message")[..],
        b"after the fork"
    );
    owner.send_copy(b"and back").await.expect("send");
    assert_eq!(
        &user.recv().await.expect("recv").expect("a message")[..],
        b"and back"
    );
    assert_eq!(echo_pattern(&mut client, 6, 2 * MIB).await, 2 * MIB);
    grant.revoke().await.expect("revoke");
    finish_echo(client, echo, 3 * MIB).await;
}
