//! Guest tests of remote memory (`tokio_rdma::remote`) on the guest's
//! soft device (rxe0, or siw0 with `--provider siw`): grants,
//! one-sided READ/WRITE and atomics between two message endpoints of one
//! process (needs the Soft-RoCE guest: `integration/softroce run -- ...`).
//! Fails, never skips, without a device.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it).
#![cfg(tokio_rdma_guest)]

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio_rdma::remote::{GrantAccess, LocalRegion, LocalSge, RemoteRegion};
use tokio_rdma::remote::{MAX_TRANSFER_BATCH, Notification, Transfer};
use tokio_rdma::{Error, Incoming, MessageConfig, MessageEndpoint};

mod common;

#[path = "../examples/shared/pattern.rs"]
#[allow(dead_code)]
mod shared;

const IP: &str = "10.11.0.1";
const MIB: usize = 1024 * 1024;

async fn pair() -> (MessageEndpoint, MessageEndpoint) {
    common::message_pair(IP, &MessageConfig::new()).await
}

/// A region of `len` bytes of `ep`'s pool filled with pattern `seed`.
async fn region(ep: &MessageEndpoint, len: usize, seed: u64) -> LocalRegion {
    let buf = ep.pool().alloc_any(len).await.expect("pool buffer");
    let r = LocalRegion::new(buf);
    r.write_at(0, &shared::pattern_vec(seed, r.len())).unwrap();
    r
}

/// A WRITE the granting NIC refuses. RoCE reports it on the WRITE
/// itself (`IBV_WC_REM_ACCESS_ERR`, `PermissionDenied`). iWARP has no
/// acknowledgement of an RDMA WRITE (RFC 5040): its completion means the
/// data was sent, and the refusal comes back as the peer's TERMINATE,
/// which fails the connection; so there the write may return `Ok` and
/// the endpoint fails right after (its `recv` errs).
async fn assert_write_refused(ep: &MessageEndpoint, result: io::Result<()>) {
    if !common::iwarp() {
        let e = result.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        assert_eq!(remote_error_status(&e), Some(10), "REM_ACCESS_ERR: {e}");
        return;
    }
    if let Err(e) = result {
        assert_ne!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        return;
    }
    let failed = tokio::time::timeout(Duration::from_secs(20), ep.recv())
        .await
        .expect("the endpoint fails after the peer's TERMINATE");
    assert!(failed.is_err(), "{failed:?}");
}

/// The memory of `region` back (`LocalRegion::try_into_memory`) once
/// nothing else holds it: a grant being revoked in the background or an
/// operation the NIC has not finished; fails after 20 s.
async fn memory_back<M: std::any::Any>(mut region: LocalRegion, what: &str) -> M {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match region.try_into_memory() {
                Ok(m) => break m,
                Err(r) => {
                    region = r;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}"))
}

fn remote_error_status(e: &io::Error) -> Option<u32> {
    match Error::from_io(e) {
        Some(Error::RemoteAccess { status, .. }) => Some(*status),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_writes_move_exact_bytes_at_unaligned_offsets() {
    let (client, server) = pair().await;
    let size = 16 * MIB + 4096;
    let reg = region(&server, size, 1).await;
    let grant = server
        .grant(&reg, 3..size - 5, GrantAccess::READ | GrantAccess::WRITE)
        .await
        .expect("grant");
    let remote = RemoteRegion::decode(&grant.remote().encode()).unwrap();
    assert_eq!(remote, grant.remote());
    assert_eq!(remote.len(), (size - 8) as u64);
    assert_eq!(remote.addr(), reg.addr() + 3);
    let whole = shared::pattern_vec(1, reg.len());
    for (offset, len) in [
        (0usize, 1usize),
        (1, 7),
        (4093, 4099),
        (12345, MIB + 3),
        (5, 16 * MIB),
    ] {
        let got = client
            .read(&remote, offset as u64, len)
            .await
            .expect("READ");
        assert_eq!(got.len(), len);
        assert!(
            got[..] == whole[3 + offset..3 + offset + len],
            "READ of {len} at {offset}"
        );
        let mut into = vec![0u8; len];
        client
            .read_into(&remote, offset as u64, &mut into)
            .await
            .expect("read_into");
        assert!(into == got[..], "read_into of {len} at {offset}");
    }
    for (offset, len, seed) in [
        (0usize, 1usize, 10u64),
        (9, 4097, 11),
        (777, 2 * MIB + 1, 12),
    ] {
        let data = shared::pattern_vec(seed, len);
        client
            .write(&remote, offset as u64, &data)
            .await
            .expect("WRITE");
        let mut back = vec![0u8; len];
        reg.read_at(3 + offset, &mut back).unwrap();
        assert!(back == data, "WRITE of {len} at {offset} landed");
        // Bytes around it unchanged.
        let mut edge = [0u8; 1];
        reg.read_at(3 + offset + len, &mut edge).unwrap();
        assert_eq!(edge[0], whole[3 + offset + len]);
    }
    assert_eq!(server.grants(), 1);
    grant.revoke().await.expect("revoke");
    assert_eq!(server.grants(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_add_from_eight_tasks_sums_exactly_and_a_cas_lock_excludes() {
    let (client, server) = pair().await;
    let reg = region(&server, 4096, 2).await;
    reg.write_at(0, &[0u8; 16]).unwrap();
    if common::iwarp() {
        // Soft-iWARP executes no atomics: refused before anything is
        // posted, and the endpoint stays usable.
        let e = server
            .grant(&reg, 0..16, GrantAccess::ATOMIC)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{e}");
        assert!(
            matches!(Error::from_io(&e), Some(Error::NoAtomics { .. })),
            "{e:?}"
        );
        let grant = server.grant(&reg, 0..16, GrantAccess::READ).await.unwrap();
        let got = client.read(&grant.remote(), 0, 16).await.unwrap();
        assert_eq!(got[..], [0u8; 16]);
        return;
    }
    let grant = server
        .grant(&reg, 0..16, GrantAccess::ATOMIC)
        .await
        .unwrap();
    let remote = grant.remote();
    let client = Arc::new(client);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let c = Arc::clone(&client);
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::with_capacity(1000);
            for _ in 0..1000 {
                seen.push(c.fetch_add(&remote, 0, 1).await.expect("fetch_add"));
            }
            seen
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort_unstable();
    assert_eq!(all, (0..8000).collect::<Vec<u64>>(), "each value once");
    assert_eq!(reg.load_u64(0).unwrap(), 8000);
    // A lock word at 8 taken and released with compare-and-swap by two
    // tasks, each incrementing a counter (READ, then WRITE) under it.
    let counter_reg = region(&server, 4096, 3).await;
    counter_reg.write_at(0, &0u64.to_ne_bytes()).unwrap();
    let counter = server
        .grant(&counter_reg, 0..8, GrantAccess::READ | GrantAccess::WRITE)
        .await
        .unwrap();
    let counter_remote = counter.remote();
    let mut tasks = Vec::new();
    for me in 1..=2u64 {
        let c = Arc::clone(&client);
        tasks.push(tokio::spawn(async move {
            for _ in 0..300 {
                while c.compare_swap(&remote, 8, 0, me).await.unwrap() != 0 {
                    tokio::task::yield_now().await;
                }
                let v = c.read(&counter_remote, 0, 8).await.unwrap();
                let v = u64::from_ne_bytes(v[..].try_into().unwrap());
                c.write(&counter_remote, 0, &(v + 1).to_ne_bytes())
                    .await
                    .unwrap();
                assert_eq!(c.compare_swap(&remote, 8, me, 0).await.unwrap(), me);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(counter_reg.load_u64(0).unwrap(), 600);
    assert_eq!(reg.load_u64(8).unwrap(), 0, "the lock is free");
    drop(grant);
    drop(counter);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ranges_fail_locally_and_refused_keys_fail_typed() {
    let (client, server) = pair().await;
    let reg = region(&server, 8192, 4).await;
    let grant = server
        .grant(&reg, 0..4096, GrantAccess::READ)
        .await
        .unwrap();
    let remote = grant.remote();
    // Checked before posting: out of range, an access not granted,
    // misaligned atomics.
    let e = client.read(&remote, 4000, 100).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    let e = client.write(&remote, 0, b"x").await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    let e = client.fetch_add(&remote, 0, 1).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    let e = server
        .grant(&reg, 0..8193, GrantAccess::READ)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    // The endpoint is still healthy after local refusals.
    let got = client.read(&remote, 0, 16).await.unwrap();
    assert_eq!(got[..], shared::pattern_vec(4, 16)[..]);
    // A forged wire form claiming WRITE on a read-only grant: the
    // granting NIC refuses it, and nothing is written.
    let mut forged = remote.encode();
    forged[1] |= 2;
    let forged = RemoteRegion::decode(&forged).unwrap();
    let r = client.write(&forged, 0, &[0xEE; 64]).await;
    assert_write_refused(&client, r).await;
    let mut head = [0u8; 64];
    reg.read_at(0, &mut head).unwrap();
    assert_eq!(head[..], shared::pattern_vec(4, 64)[..], "nothing written");
    // An RC QP is in the error state after a remote access error: the
    // endpoint failed with it.
    let e = client.read(&remote, 0, 16).await.unwrap_err();
    assert_ne!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_grant_and_another_connections_grant_are_refused() {
    let (client, server) = pair().await;
    let reg = region(&server, 4096, 5).await;
    let grant = server
        .grant(&reg, 0..4096, GrantAccess::READ | GrantAccess::WRITE)
        .await
        .unwrap();
    let remote = grant.remote();
    assert_eq!(
        client.read(&remote, 0, 8).await.unwrap()[..],
        shared::pattern_vec(5, 8)[..]
    );
    grant.revoke().await.expect("revoked");
    let r = client.write(&remote, 0, &[0xAB; 32]).await;
    assert_write_refused(&client, r).await;
    let mut head = [0u8; 32];
    reg.read_at(0, &mut head).unwrap();
    assert_eq!(head[..], shared::pattern_vec(5, 32)[..], "nothing written");

    // A grant bound on connection A, used through connection B.
    let (a_client, a_server) = pair().await;
    let (b_client, _b_server) = pair().await;
    let reg = region(&a_server, 4096, 6).await;
    let grant = a_server
        .grant(&reg, 0..4096, GrantAccess::READ)
        .await
        .unwrap();
    let e = b_client.read(&grant.remote(), 0, 8).await.unwrap_err();
    if common::iwarp() {
        // Soft-iWARP flushes a READ the responder TERMINATEd (or the
        // disconnect comes first): refused all the same.
        assert_ne!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    } else {
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
    }
    // ... and works through A.
    let got = a_client.read(&grant.remote(), 0, 8).await.unwrap();
    assert_eq!(got[..], shared::pattern_vec(6, 8)[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_dropped_in_flight_never_writes_into_reused_memory() {
    let (client, server) = pair().await;
    let size = 16 * MIB;
    let reg = region(&server, size, 7).await;
    let grant = server
        .grant(&reg, 0..size, GrantAccess::READ)
        .await
        .unwrap();
    let remote = grant.remote();
    let pool = client.pool().clone();
    for round in 0..5 {
        let r = tokio::time::timeout(Duration::from_millis(1), client.read(&remote, 0, size)).await;
        assert!(r.is_err(), "round {round}: the 16 MiB READ outlasts 1 ms");
        // Refill the pool with a pattern at once: the READ's destination
        // is still with the ledger, so none of these is it.
        let mut bufs = Vec::new();
        for _ in 0..4 {
            let mut b = pool.alloc_any(size).await.unwrap();
            b.spare_mut()[..size].fill(0x5A);
            b.set_len(size);
            bufs.push(b);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b.iter().all(|&x| x == 0x5A),
                "round {round}: buffer {i} unchanged after the dropped READ"
            );
        }
    }
    // The endpoint is healthy: a whole read works.
    let got = client.read(&remote, 0, size).await.unwrap();
    assert!(got[..] == shared::pattern_vec(7, size)[..]);
    assert_eq!(client.stats().buffers_held_for_nic, 0);
}

/// A peer process killed while 4 tasks READ (then, on a second peer,
/// WRITE) 64 KiB from its grant in a loop: every task's operation ends
/// with a typed error within the bound (the RC retry bound, or rdma_cm's
/// DISCONNECTED), none hangs, and once the endpoint is dropped every verbs
/// object of the connection (QP, CQ, windows, cm id) and fd is back at
/// the start. Before tokio's cooperative budget was consumed per
/// operation, the 4 tasks never yielded (rxe completed their READs inside
/// the post) and the test hung with the runtime's timers stopped. The
/// peer is `remote_bench
/// --serve` (a grant of 1 MiB: READ, WRITE, atomics).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_during_reads_and_writes_fails_them_typed_and_frees_everything() {
    use tokio::io::AsyncBufReadExt as _;
    // The process-wide fds (the device, the rdma_cm and completion
    // channels) open with the first connection: the second round must end
    // with the fds the first ended with.
    let mut fds_after_first: Option<usize> = None;
    for write in [false, true] {
        // A pool of the endpoint's own, opened (with the device) before
        // counting: once the endpoint, its grant and the pool are dropped,
        // every registration is gone too.
        let pool = tokio_rdma::pool::MemoryPool::for_device(
            &common::device(),
            tokio_rdma::pool::PoolConfig::new().max_registered_bytes(32 << 20),
        )
        .unwrap();
        let start = tokio_rdma::stats::resources();
        let mut child = tokio::process::Command::new(common::example("remote_bench"))
            .args(["--addr", IP, "--serve", &format!("{IP}:0")])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("remote_bench");
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the peer's address");
        let addr: std::net::SocketAddr = line
            .strip_prefix("listening on ")
            .expect("listening on ADDR")
            .parse()
            .unwrap();
        let ep = MessageEndpoint::connect_with(addr, &MessageConfig::new().pool(pool.clone()))
            .await
            .unwrap();
        // (The message is a receive buffer of the pool: dropped here.)
        let remote = RemoteRegion::decode(&ep.recv().await.unwrap().expect("the grant")).unwrap();
        // A grant of this side's, outstanding when the peer dies.
        let mine = LocalRegion::new(ep.pool().alloc_any(1 << 20).await.unwrap());
        let my_grant = ep
            .grant(&mine, 0..1 << 20, GrantAccess::READ)
            .await
            .unwrap();
        let ep = Arc::new(ep);
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..4u64 {
            let (ep, done) = (Arc::clone(&ep), Arc::clone(&done));
            tasks.spawn(async move {
                let data = vec![t as u8; 64 * 1024];
                loop {
                    let r = if write {
                        ep.write(&remote, t * 65536, &data).await.map(drop)
                    } else {
                        ep.read(&remote, t * 65536, 65536).await.map(drop)
                    };
                    match r {
                        Ok(()) => {
                            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(e) => return e,
                    }
                }
            });
        }
        // Let operations flow, then kill the peer mid-operation.
        let flowing = async {
            while done.load(std::sync::atomic::Ordering::Relaxed) < 40 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), flowing)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "write {write}: only {} operations in 60 s, tasks finished: {}",
                    done.load(std::sync::atomic::Ordering::Relaxed),
                    tasks.len()
                )
            });
        eprintln!(
            "write {write}: {} operations before the kill",
            done.load(std::sync::atomic::Ordering::Relaxed)
        );
        child.kill().await.unwrap();
        let mut errors = 0;
        let all = async {
            while let Some(r) = tasks.join_next().await {
                let e = r.unwrap();
                assert!(
                    matches!(
                        Error::from_io(&e),
                        Some(
                            Error::RemoteAccess { .. }
                                | Error::PeerDisconnected
                                | Error::WorkCompletion { .. }
                                | Error::KeepaliveTimeout { .. }
                        )
                    ),
                    "typed error, write {write}: {e:?}"
                );
                errors += 1;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), all)
            .await
            .expect("every operation's future resolves");
        assert_eq!(errors, 4);
        my_grant
            .revoke()
            .await
            .expect("a grant on a failed endpoint revokes Ok");
        drop((ep, mine, pool));
        // Every object and registration of the connection and its pool is
        // gone (the device keeps its PD, opened before `start`).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while common::without_cache(tokio_rdma::stats::resources()) != common::without_cache(start)
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(
            common::without_cache(tokio_rdma::stats::resources()),
            common::without_cache(start),
            "write {write}: {:?} vs {start:?}",
            tokio_rdma::stats::resources()
        );
        let fds = common::open_fds();
        if let Some(first) = fds_after_first {
            assert!(
                fds.abs_diff(first) <= 2,
                "fds {fds} after the second round, {first} after the first"
            );
        }
        fds_after_first = Some(fds);
    }
}

/// `write_notify`: each write's bytes are in place when its notification
/// arrives, and notifications come in order with the writer's messages
/// (sizes 0 B to 64 KiB + 3 at unaligned offsets); `recv` leaves a
/// notification in place with `InvalidData`; bad input fails locally and
/// posts nothing; a revoked grant fails the writer with a remote access
/// error and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_notify_lands_before_its_notification_in_message_order() {
    const SLOT: usize = 70_000;
    const ITEMS: usize = 48;
    let (client, server) = pair().await;
    let reg = region(&server, SLOT * ITEMS, 7).await;
    let grant = server
        .grant(&reg, 0..reg.len(), GrantAccess::WRITE)
        .await
        .expect("grant");
    let remote = grant.remote();

    // A notification first: `recv` refuses it and leaves it in place.
    client.write_notify(&remote, 1, b"first", 77).await.unwrap();
    let e = server.recv().await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    match server.recv_incoming().await.unwrap() {
        Some(Incoming::Notification(n)) => assert_eq!(n, Notification { value: 77, len: 5 }),
        other => panic!("{other:?}"),
    }
    let mut first = [0u8; 5];
    reg.read_at(1, &mut first).unwrap();
    assert_eq!(&first, b"first");

    let sizes = [0usize, 1, 63, 4096, 4097, 65_539];
    let writer = async {
        for i in 0..ITEMS {
            let len = sizes[i % sizes.len()];
            let data = shared::pattern_vec(100 + i as u64, len);
            if i % 3 == 2 {
                client.send_copy(&data).await.unwrap();
            } else {
                let offset = (i * SLOT + i % 7) as u64;
                client
                    .write_notify(&remote, offset, &data, i as u32)
                    .await
                    .unwrap();
            }
        }
        client.flush().await.unwrap();
    };
    let reader = async {
        for i in 0..ITEMS {
            let len = sizes[i % sizes.len()];
            let data = shared::pattern_vec(100 + i as u64, len);
            match server.recv_incoming().await.unwrap() {
                Some(Incoming::Message(m)) => {
                    assert_eq!(i % 3, 2, "item {i} came as a message");
                    assert!(m[..] == data[..], "message {i}");
                }
                Some(Incoming::Notification(n)) => {
                    assert_ne!(i % 3, 2, "item {i} came as a notification");
                    assert_eq!(
                        n,
                        Notification {
                            value: i as u32,
                            len: len as u32
                        }
                    );
                    let mut landed = vec![0u8; len];
                    reg.read_at(i * SLOT + i % 7, &mut landed).unwrap();
                    assert!(landed == data, "write {i} in place");
                }
                None => panic!("the end before item {i}"),
            }
        }
    };
    tokio::join!(writer, reader);
    let (c, s) = (client.stats(), server.stats());
    assert_eq!(c.notifications_sent, 1 + 32);
    assert_eq!(s.notifications_received, 1 + 32);
    assert_eq!(s.messages_received, 16);

    // Bad input: nothing posted.
    let before = client.stats().wrs_posted;
    for (offset, len, value) in [
        (0u64, 8usize, 1u32 << 29),
        (remote.len() - 4, 8, 1),
        (remote.len() + 1, 0, 1),
    ] {
        let e = client
            .write_notify(&remote, offset, &vec![1u8; len], value)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    }
    let read_only = server
        .grant(&reg, 0..64, GrantAccess::READ)
        .await
        .expect("grant");
    let e = client
        .write_notify(&read_only.remote(), 0, b"x", 1)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    assert_eq!(client.stats().wrs_posted, before);

    // A revoked grant: the writer fails typed, nothing lands, and the
    // owner gets no notification.
    let mut head = vec![0u8; 64];
    reg.read_at(SLOT * 2, &mut head).unwrap();
    grant.revoke().await.expect("revoke");
    let queued = client
        .write_notify(&remote, (SLOT * 2) as u64, &[0xEE; 64], 5)
        .await;
    let flushed = match queued {
        Ok(()) => client.flush().await,
        Err(e) => Err(e),
    };
    if common::iwarp() {
        // iWARP acknowledges no WRITE (RFC 5040): the WRITE and the SEND
        // after it complete once sent, and the owner's TERMINATE fails
        // the endpoint, possibly after the flush returned.
        let e = match flushed {
            Err(e) => e,
            Ok(()) => tokio::time::timeout(Duration::from_secs(20), client.recv())
                .await
                .expect("the endpoint fails after the owner's TERMINATE")
                .unwrap_err(),
        };
        assert_ne!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    } else {
        let e = flushed.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        assert!(
            matches!(
                Error::from_io(&e),
                Some(Error::RemoteAccess {
                    op: "RDMA WRITE WITH IMMEDIATE",
                    status: 10
                })
            ),
            "{e:?}"
        );
    }
    let got = tokio::time::timeout(Duration::from_secs(20), server.recv_incoming())
        .await
        .expect("the owner's endpoint ends");
    assert!(
        !matches!(got, Ok(Some(Incoming::Notification(_)))),
        "{got:?}"
    );
    let mut after = vec![0u8; 64];
    reg.read_at(SLOT * 2, &mut after).unwrap();
    assert_eq!(after, head, "nothing written through the revoked grant");
}

/// `transfer`: 32 READs and WRITEs posted with one doorbell move exact
/// bytes (the reads come back in batch order); more than 32, or one bad
/// operation, fails locally and posts nothing (the valid writes before
/// it included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_posts_a_batch_and_refuses_a_bad_one_whole() {
    let (client, server) = pair().await;
    let size = 2 * MIB;
    let reg = region(&server, size, 8).await;
    let whole = shared::pattern_vec(8, size);
    let grant = server
        .grant(&reg, 0..size, GrantAccess::READ | GrantAccess::WRITE)
        .await
        .expect("grant");
    let remote = grant.remote();
    // Half WRITEs, half READs, interleaved: a full batch. No READ
    // overlaps a later WRITE: on iWARP a WRITE may be placed before an
    // earlier READ of the same bytes was answered (RFC 5040, 5.5).
    let pairs = (MAX_TRANSFER_BATCH / 2) as u64;
    let writes: Vec<(u64, Vec<u8>)> = (0..pairs)
        .map(|k| {
            (
                k * 131_072 + 3,
                shared::pattern_vec(200 + k, 4096 + k as usize),
            )
        })
        .collect();
    let reads: Vec<(u64, usize)> = (0..pairs)
        .map(|k| (k * 131_072 + 65_539, 1 + 4093 * k as usize))
        .collect();
    let mut ops = Vec::new();
    for (w, r) in writes.iter().zip(&reads) {
        ops.push(Transfer::Write {
            remote: &remote,
            offset: w.0,
            data: &w.1,
        });
        ops.push(Transfer::Read {
            remote: &remote,
            offset: r.0,
            len: r.1,
        });
    }
    assert_eq!(ops.len(), MAX_TRANSFER_BATCH);
    let got = client.transfer(&ops).await.expect("the batch");
    assert_eq!(got.len(), MAX_TRANSFER_BATCH / 2);
    for (bytes, &(offset, len)) in got.iter().zip(&reads) {
        let at = offset as usize;
        assert!(
            bytes[..] == whole[at..at + len],
            "READ of {len} at {offset}"
        );
    }
    for (offset, data) in &writes {
        let mut back = vec![0u8; data.len()];
        reg.read_at(*offset as usize, &mut back).unwrap();
        assert!(back == *data, "WRITE at {offset}");
    }
    assert_eq!(client.transfer(&[]).await.unwrap().len(), 0);

    // Refused whole, before anything is posted.
    let fresh = [0x5Au8; 64];
    let mut too_many = vec![
        Transfer::Write {
            remote: &remote,
            offset: 0,
            data: &fresh,
        };
        MAX_TRANSFER_BATCH
    ];
    too_many.push(Transfer::Read {
        remote: &remote,
        offset: 0,
        len: 8,
    });
    let e = client.transfer(&too_many).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    let bad = [
        Transfer::Write {
            remote: &remote,
            offset: 0,
            data: &fresh,
        },
        Transfer::Read {
            remote: &remote,
            offset: size as u64 - 4,
            len: 8,
        },
    ];
    // What the first batch left there: 3 bytes of the pattern, then its
    // first WRITE.
    let mut before = whole[..64].to_vec();
    before[3..].copy_from_slice(&writes[0].1[..61]);
    let e = client.transfer(&bad).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    let mut head = [0u8; 64];
    reg.read_at(0, &mut head).unwrap();
    assert_eq!(head[..], before[..], "nothing of the refused batch written");
    // The endpoint still works.
    let again = client
        .transfer(&[Transfer::Read {
            remote: &remote,
            offset: 5,
            len: 11,
        }])
        .await
        .unwrap();
    assert_eq!(again[0][..], before[5..16]);
}

/// Memory of the caller's, registered as regions: a `Vec`, a file mapping
/// and a huge-page mapping. The peer reads, writes and adds into them
/// through grants; the owner gets each back (only once no grant holds
/// it) with exactly the peer's bytes in it, and the file has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_user_memory_is_granted_and_given_back_with_the_peers_writes() {
    let (client, server) = pair().await;
    let rw = GrantAccess::READ | GrantAccess::WRITE;

    // A Vec: no copy, the region is its bytes.
    let len = MIB + 13;
    let v = shared::pattern_vec(21, len);
    let addr = v.as_ptr() as u64;
    let reg = server.pool().register_local(v).expect("register a Vec");
    assert_eq!((reg.addr(), reg.len()), (addr, len));
    let grant = server.grant(&reg, 5..len, rw).await.expect("grant");
    let remote = grant.remote();
    let got = client.read(&remote, 0, len - 5).await.expect("READ");
    assert!(got[..] == shared::pattern_vec(21, len)[5..], "READ whole");
    let data = shared::pattern_vec(22, 4099);
    client.write(&remote, 777, &data).await.expect("WRITE");
    let reg = reg
        .try_into_memory::<Vec<u8>>()
        .expect_err("a grant holds it");
    grant.revoke().await.expect("revoke");
    let back: Vec<u8> = reg.try_into_memory().expect("nothing holds it");
    let mut want = shared::pattern_vec(21, len);
    want[5 + 777..5 + 777 + 4099].copy_from_slice(&data);
    assert_eq!(back.as_ptr() as u64, addr);
    assert!(back == want, "the Vec holds exactly the peer's WRITE");

    // A shared file mapping: the peer's WRITE reaches the file.
    let path = std::env::temp_dir().join(format!("tokio-rdma-region-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("create the file");
    let flen = 64 * 1024 + 100;
    file.set_len(flen as u64).expect("size the file");
    // SAFETY: the file is this test's own, created above; nothing else
    // maps or truncates it while the mapping lives.
    let map = unsafe { memmap2::MmapMut::map_mut(&file) }.expect("map the file");
    let reg = server
        .pool()
        .register_local(map)
        .expect("register a mapping");
    let grant = server.grant(&reg, 0..flen, rw).await.expect("grant");
    let data = shared::pattern_vec(23, flen);
    client
        .write(&grant.remote(), 0, &data)
        .await
        .expect("WRITE");
    let got = client.read(&grant.remote(), 99, 1000).await.expect("READ");
    assert!(got[..] == data[99..1099]);
    drop(grant); // revoked in the background
    let map: memmap2::MmapMut = memory_back(reg, "the mapping comes back once revoked").await;
    assert_eq!(server.grants(), 0);
    map.flush().expect("msync");
    drop(map);
    assert!(std::fs::read(&path).expect("read the file") == data);
    std::fs::remove_file(&path).unwrap();

    // Huge pages (2 MiB, reserved here): atomics land in them.
    std::fs::write("/proc/sys/vm/nr_hugepages", "4").expect("reserve huge pages");
    let huge = memmap2::MmapOptions::new()
        .len(2 * MIB)
        .huge(Some(21))
        .map_anon()
        .expect("a huge-page mapping");
    let reg = server
        .pool()
        .register_local(huge)
        .expect("register huge pages");
    assert_eq!(reg.addr() % (2 * MIB) as u64, 0);
    let access = if common::iwarp() {
        rw
    } else {
        rw | GrantAccess::ATOMIC
    };
    let grant = server.grant(&reg, 0..2 * MIB, access).await.expect("grant");
    let remote = grant.remote();
    if common::iwarp() {
        client
            .write(&remote, 4096, &7u64.to_ne_bytes())
            .await
            .unwrap();
    } else {
        for i in 0..7u64 {
            assert_eq!(client.fetch_add(&remote, 4096, 1).await.unwrap(), i);
        }
    }
    assert_eq!(reg.load_u64(4096).unwrap(), 7);
    let data = shared::pattern_vec(24, 3 * 4096);
    client
        .write(&remote, 2 * MIB as u64 - data.len() as u64, &data)
        .await
        .unwrap();
    let mut back = vec![0u8; data.len()];
    reg.read_at(2 * MIB - data.len(), &mut back).unwrap();
    assert!(back == data);
    grant.revoke().await.unwrap();

    // Memory registered with another pool on the same device: on a device
    // with memory windows the window binds on its MR; without (iWARP), a
    // grant needs the endpoint's own pool (its connection's own PD).
    let other = tokio_rdma::MemoryPool::for_device(server.device(), Default::default())
        .expect("another pool");
    let reg = other.register_local(vec![9u8; 8192]).unwrap();
    let result = server.grant(&reg, 100..200, GrantAccess::READ).await;
    if common::iwarp() {
        assert_eq!(result.unwrap_err().kind(), io::ErrorKind::InvalidInput);
    } else {
        let grant = result.expect("grant on another pool of the device");
        let got = client.read(&grant.remote(), 0, 100).await.unwrap();
        assert_eq!(got[..], [9u8; 100]);
    }
}

/// `read_to`, `write_from` and their batched forms move bytes in place
/// of a registered region (no pool buffer): exact bytes at unaligned
/// offsets, nothing around them touched; a range past the region is
/// refused before posting; a `read_to` dropped in flight keeps the region
/// (and its memory) until the NIC is done, then gives it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_to_and_write_from_move_bytes_in_place_of_a_registered_region() {
    let (client, server) = pair().await;
    let size = 4 * MIB + 7;
    let reg = region(&server, size, 31).await;
    let grant = server
        .grant(&reg, 0..size, GrantAccess::READ | GrantAccess::WRITE)
        .await
        .expect("grant");
    let remote = grant.remote();
    // What the granted region holds, kept up to date with the WRITEs.
    let mut theirs = shared::pattern_vec(31, reg.len());
    let mine = client
        .pool()
        .register_local(vec![0u8; 8 * MIB])
        .expect("register");

    let len = 2 * MIB + 1;
    client
        .read_to(&remote, 3, &mine, 5, len)
        .await
        .expect("read_to");
    let mut got = vec![0u8; len + 10];
    mine.read_at(0, &mut got).unwrap();
    assert_eq!(got[..5], [0u8; 5], "nothing before the range");
    assert!(got[5..5 + len] == theirs[3..3 + len], "the READ in place");
    assert_eq!(got[5 + len..], [0u8; 5], "nothing after it");

    let data = shared::pattern_vec(32, MIB + 3);
    mine.write_at(4 * MIB, &data).unwrap();
    client
        .write_from(&remote, 11, &mine, 4 * MIB, data.len())
        .await
        .expect("write_from");
    let mut back = vec![0u8; data.len() + 1];
    reg.read_at(11, &mut back).unwrap();
    assert!(back[..data.len()] == data, "the WRITE from the region");
    assert_eq!(back[data.len()], theirs[11 + data.len()]);
    theirs[11..11 + data.len()].copy_from_slice(&data);

    // A batch: 8 READs in place, 7 WRITEs from the region, 1 READ into a
    // pool buffer.
    let mut ops = Vec::new();
    for i in 0..8usize {
        ops.push(Transfer::ReadTo {
            remote: &remote,
            offset: (i * 4096 + i) as u64,
            dst: &mine,
            at: 6 * MIB + i * 8192,
            len: 4096 + i,
        });
    }
    for i in 0..7usize {
        ops.push(Transfer::WriteFrom {
            remote: &remote,
            offset: (3 * MIB + i * 4096) as u64,
            src: &mine,
            at: 4 * MIB + i * 100,
            len: 4000,
        });
    }
    ops.push(Transfer::Read {
        remote: &remote,
        offset: 1,
        len: 77,
    });
    let read = client.transfer(&ops).await.expect("transfer");
    assert_eq!(read.len(), 1, "only the pool READ returns bytes");
    assert!(read[0][..] == theirs[1..78]);
    for i in 0..8usize {
        let mut got = vec![0u8; 4096 + i];
        mine.read_at(6 * MIB + i * 8192, &mut got).unwrap();
        assert!(
            got[..] == theirs[i * 4096 + i..i * 4096 + i + 4096 + i],
            "ReadTo {i}"
        );
    }
    for i in 0..7usize {
        let mut got = vec![0u8; 4000];
        reg.read_at(3 * MIB + i * 4096, &mut got).unwrap();
        assert!(got[..] == data[i * 100..i * 100 + 4000], "WriteFrom {i}");
    }

    // Refused before posting: past the region's end (alone and in a batch).
    let e = client
        .read_to(&remote, 0, &mine, 8 * MIB - 3, 4)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    let e = client
        .transfer(&[Transfer::WriteFrom {
            remote: &remote,
            offset: 0,
            src: &mine,
            at: usize::MAX,
            len: 2,
        }])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");

    // Dropped in flight: the endpoint keeps the region until the NIC is
    // done, then it can be taken back; bytes outside the range untouched.
    {
        let read = client.read_to(&remote, 0, &mine, 0, 4 * MIB);
        tokio::pin!(read);
        let polled = futures::poll!(read.as_mut());
        assert!(polled.is_pending(), "a 4 MiB READ is in flight");
    }
    let back: Vec<u8> = memory_back(mine, "the region comes back once the READ completed").await;
    assert!(back[4 * MIB..4 * MIB + data.len()] == data);
    // The endpoint is unharmed.
    assert!(client.read(&remote, 0, 64).await.unwrap()[..] == theirs[..64]);
    grant.revoke().await.expect("revoke");
}

/// Scatter-gather lists: one RDMA WRITE gathers entries of two regions at
/// unaligned offsets and one RDMA READ scatters over them, exact bytes;
/// the limits are what the device grants (rxe: the 4 asked for, READs as
/// well; siw: READs take 1, its `max_sge_rd`), and a connection asking
/// for 8 gets 8 on rxe. A list that is empty, one entry too long, has an
/// empty entry or passes the grant fails locally with `InvalidInput` and
/// posts nothing: the granted bytes are unchanged and the endpoint goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scatter_gather_lists_move_exact_bytes_and_bad_lists_post_nothing() {
    let (client, server) = pair().await;
    let size = MIB;
    let reg = region(&server, size, 51).await;
    let grant = server
        .grant(&reg, 0..size, GrantAccess::READ | GrantAccess::WRITE)
        .await
        .expect("grant");
    let remote = grant.remote();
    let a = client
        .pool()
        .register_local(shared::pattern_vec(52, 64 * 1024))
        .unwrap();
    let b = client
        .pool()
        .register_local(shared::pattern_vec(53, 64 * 1024))
        .unwrap();
    assert_eq!(client.max_sge(), 4);
    let read_sges = if common::iwarp() { 1 } else { 4 };
    assert_eq!(client.max_read_sge(), read_sges);

    // Gather: a 3 B..1003, b 17..4110, a 5000 (1 B), b 60000..65000.
    let gather = [
        LocalSge::new(&a, 3, 1000),
        LocalSge::new(&b, 17, 4093),
        LocalSge::new(&a, 5000, 1),
        LocalSge::new(&b, 60_000, 5000),
    ];
    let mut expect = Vec::new();
    for e in &gather {
        let mut part = vec![0u8; e.len];
        e.region.read_at(e.at, &mut part).unwrap();
        expect.extend_from_slice(&part);
    }
    let at = 12_345usize;
    let got = client
        .transfer(&[Transfer::WriteGather {
            remote: &remote,
            offset: at as u64,
            src: &gather,
        }])
        .await
        .expect("gathered WRITE");
    assert!(got.is_empty());
    let mut landed = vec![0u8; expect.len()];
    reg.read_at(at, &mut landed).unwrap();
    assert!(landed == expect, "the gathered bytes, in list order");
    let theirs = shared::pattern_vec(51, size);
    let mut before = vec![0u8; 8];
    reg.read_at(at - 8, &mut before).unwrap();
    assert_eq!(before, theirs[at - 8..at], "nothing before the WRITE");
    let end = at + expect.len();
    let mut after = vec![0u8; 8];
    reg.read_at(end, &mut after).unwrap();
    assert_eq!(after, theirs[end..end + 8], "nothing after the WRITE");

    // Scatter: 777.. of the grant over b 100 (7 B), a 2000 (3000 B),
    // b 20000 (1 B), a 40000 (4096 B), as many as READs take.
    let scatter_all = [
        LocalSge::new(&b, 100, 7),
        LocalSge::new(&a, 2000, 3000),
        LocalSge::new(&b, 20_000, 1),
        LocalSge::new(&a, 40_000, 4096),
    ];
    let scatter = &scatter_all[..read_sges];
    let from = 777usize;
    client
        .transfer(&[Transfer::ReadScatter {
            remote: &remote,
            offset: from as u64,
            dst: scatter,
        }])
        .await
        .expect("scattered READ");
    let mut pos = from;
    for (i, e) in scatter.iter().enumerate() {
        let mut part = vec![0u8; e.len];
        e.region.read_at(e.at, &mut part).unwrap();
        assert!(part == theirs[pos..pos + e.len], "entry {i}");
        pos += e.len;
    }

    // Refused whole: nothing posted, nothing written.
    let fresh = client.pool().register_local(vec![0xEEu8; 4096]).unwrap();
    let five: Vec<LocalSge<'_>> = (0..5).map(|k| LocalSge::new(&fresh, k * 8, 8)).collect();
    let bad: [(&str, Transfer<'_>); 5] = [
        (
            "empty list",
            Transfer::WriteGather {
                remote: &remote,
                offset: 0,
                src: &[],
            },
        ),
        (
            "one entry too many",
            Transfer::WriteGather {
                remote: &remote,
                offset: 0,
                src: &five,
            },
        ),
        (
            "an empty entry",
            Transfer::WriteGather {
                remote: &remote,
                offset: 0,
                src: &[LocalSge::new(&fresh, 0, 8), LocalSge::new(&fresh, 8, 0)],
            },
        ),
        (
            "past the grant",
            Transfer::WriteGather {
                remote: &remote,
                offset: (size - 8) as u64,
                src: &[LocalSge::new(&fresh, 0, 8), LocalSge::new(&fresh, 8, 1)],
            },
        ),
        (
            "past the local region",
            Transfer::ReadScatter {
                remote: &remote,
                offset: 0,
                dst: &[LocalSge::new(&fresh, 4000, 97)],
            },
        ),
    ];
    let whole_before = {
        let mut v = vec![0u8; size];
        reg.read_at(0, &mut v).unwrap();
        v
    };
    for (what, op) in bad {
        let e = client
            .transfer(&[
                Transfer::Write {
                    remote: &remote,
                    offset: 64,
                    data: &[0x11; 64],
                },
                op,
            ])
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{what}: {e}");
    }
    let mut whole_after = vec![0u8; size];
    reg.read_at(0, &mut whole_after).unwrap();
    assert!(
        whole_after == whole_before,
        "nothing written by a refused batch"
    );
    let mut untouched = vec![0u8; 4096];
    fresh.read_at(0, &mut untouched).unwrap();
    assert!(
        untouched.iter().all(|&x| x == 0xEE),
        "nothing read into the region"
    );
    let got = client
        .read(&remote, 0, 64)
        .await
        .expect("the endpoint goes on");
    assert!(got[..] == whole_before[..64]);

    // A connection that asks for 8 entries gets them where the device
    // has them (rxe: 32; siw: 6, and READs 1).
    let (client8, server8) = common::message_pair(IP, &MessageConfig::new().max_sge(8)).await;
    let want = if common::iwarp() { 6 } else { 8 };
    assert_eq!(client8.max_sge(), want);
    let reg8 = region(&server8, 64 * 1024, 54).await;
    let grant8 = server8
        .grant(&reg8, 0..64 * 1024, GrantAccess::WRITE)
        .await
        .expect("grant");
    let remote8 = grant8.remote();
    let src = client8
        .pool()
        .register_local(shared::pattern_vec(55, 4096))
        .unwrap();
    let list: Vec<LocalSge<'_>> = (0..want)
        .map(|k| LocalSge::new(&src, 4096 - 100 * (k + 1), 100))
        .collect();
    client8
        .transfer(&[Transfer::WriteGather {
            remote: &remote8,
            offset: 1,
            src: &list,
        }])
        .await
        .expect("a list of the most entries");
    let mine = shared::pattern_vec(55, 4096);
    let mut landed = vec![0u8; 100 * want];
    reg8.read_at(1, &mut landed).unwrap();
    for k in 0..want {
        let from = 4096 - 100 * (k + 1);
        assert!(
            landed[k * 100..(k + 1) * 100] == mine[from..from + 100],
            "entry {k}"
        );
    }
}

/// A batch dropped in flight (16 operations: 1 MiB READs into pool
/// buffers, READs in place and WRITEs from a registered region): every
/// buffer stays with the endpoint's ledger until its WR completed, so
/// pool buffers allocated at once and filled with a pattern keep it, and
/// the region comes back only once the NIC is done; afterwards nothing is
/// held for the NIC and the endpoint moves exact bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_dropped_in_flight_keeps_every_buffer_until_its_completion() {
    let (client, server) = pair().await;
    let size = 16 * MIB;
    let reg = region(&server, size, 41).await;
    let grant = server
        .grant(&reg, 0..size, GrantAccess::READ | GrantAccess::WRITE)
        .await
        .unwrap();
    let remote = grant.remote();
    let mine = client
        .pool()
        .register_local(shared::pattern_vec(42, 8 * MIB))
        .unwrap();
    // Half a full batch: 16 MiB in flight.
    const OPS: usize = MAX_TRANSFER_BATCH / 2;
    let ops: Vec<Transfer<'_>> = (0..OPS)
        .map(|k| match k % 3 {
            0 => Transfer::Read {
                remote: &remote,
                offset: (k * MIB) as u64,
                len: MIB,
            },
            1 => Transfer::ReadTo {
                remote: &remote,
                offset: (k * MIB) as u64,
                dst: &mine,
                at: (k / 3) * MIB,
                len: MIB,
            },
            _ => Transfer::WriteFrom {
                remote: &remote,
                offset: (k * MIB) as u64,
                src: &mine,
                at: 6 * MIB,
                len: MIB,
            },
        })
        .collect();
    let pool = client.pool().clone();
    for round in 0..3 {
        {
            let batch = client.transfer(&ops);
            tokio::pin!(batch);
            assert!(
                futures::poll!(batch.as_mut()).is_pending(),
                "round {round}: 16 MiB in flight"
            );
        }
        let held = client.stats().buffers_held_for_nic;
        assert!(
            held > 0,
            "round {round}: the ledger holds the batch's buffers"
        );
        let mut bufs = Vec::new();
        for _ in 0..8 {
            let mut b = pool.alloc_any(MIB).await.unwrap();
            b.spare_mut()[..MIB].fill(0xA5);
            b.set_len(MIB);
            bufs.push(b);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b.iter().all(|&x| x == 0xA5),
                "round {round}: buffer {i} unchanged after the dropped batch"
            );
        }
    }
    let back: Vec<u8> = memory_back(mine, "the region comes back once its WRs completed").await;
    // What the READs in place left: the granted bytes they read.
    let theirs = shared::pattern_vec(41, reg.len());
    for k in (1..OPS).step_by(3) {
        let at = (k / 3) * MIB;
        assert!(
            back[at..at + MIB] == theirs[k * MIB..(k + 1) * MIB],
            "ReadTo {k}"
        );
    }
    assert_eq!(client.stats().buffers_held_for_nic, 0);
    let got = client.read(&remote, 0, 64).await.unwrap();
    assert!(got[..] == theirs[..64]);
}
