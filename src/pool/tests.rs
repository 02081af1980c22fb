//! Host tests of the pool and registered regions with [`FakeRegistrar`].

use std::collections::HashSet;
use std::io::{self, Write as _};
use std::time::Duration;

use bytes::{BufMut as _, Bytes};

use super::*;

const MIB: usize = 1024 * 1024;

fn pool(config: PoolConfig) -> (MemoryPool, FakeRegistrar) {
    let fake = FakeRegistrar::new();
    let pool = MemoryPool::with_registrar(fake.clone(), config).unwrap();
    (pool, fake)
}

fn error_pool(max: usize) -> (MemoryPool, FakeRegistrar) {
    pool(
        PoolConfig::new()
            .max_registered_bytes(max as u64)
            .exhausted_policy(ExhaustedPolicy::Error),
    )
}

#[test]
fn class_selection_picks_smallest_class_at_least_len() {
    let (p, _) = pool(PoolConfig::default());
    for (len, class) in [
        (0, 4096),
        (1, 4096),
        (4096, 4096),
        (4097, 8192),
        (8192, 8192),
        (65_535, 65_536),
        (MIB - 1, MIB),
        (MIB, MIB),
    ] {
        assert_eq!(p.class_size(len).unwrap(), class, "len {len}");
        let b = p.try_alloc(len).unwrap();
        assert_eq!((b.capacity(), b.len()), (class, 0), "len {len}");
    }
    for len in [MIB + 1, usize::MAX] {
        let err = p.try_alloc(len).unwrap_err();
        assert!(
            matches!(err, PoolError::TooLarge { len: l, max_class } if l == len && max_class == MIB),
            "{err:?}"
        );
        assert_eq!(io::Error::from(err).kind(), io::ErrorKind::InvalidInput);
    }
}

#[test]
fn slab_is_carved_into_1024_distinct_aligned_4k_buffers() {
    let (p, fake) = pool(PoolConfig::default());
    let bufs: Vec<PoolBuf> = (0..1024).map(|_| p.try_alloc(1).unwrap()).collect();
    assert_eq!(fake.registrations(), 1);
    assert_eq!(fake.registered_bytes(), 4 * MIB as u64);
    let addrs: HashSet<u64> = bufs.iter().map(|b| b.addr()).collect();
    assert_eq!(addrs.len(), 1024);
    let lo = *addrs.iter().min().unwrap();
    let hi = *addrs.iter().max().unwrap();
    assert_eq!(
        hi - lo,
        (4 * MIB - 4096) as u64,
        "all inside one 4 MiB slab"
    );
    assert!(addrs.iter().all(|a| (a - lo) % 4096 == 0 && a % 4096 == 0));
    assert!(
        bufs.iter()
            .all(|b| b.lkey() == 0x1000_0001 && b.rkey() == 0x2000_0001)
    );
    assert_eq!(bufs[0].addr(), lo, "handed out in ascending order");

    // The 1025th needs a second slab with its own keys.
    let extra = p.try_alloc(4096).unwrap();
    assert_eq!(fake.registrations(), 2);
    assert_eq!((extra.lkey(), extra.rkey()), (0x1000_0002, 0x2000_0002));
    assert!(!(lo..=hi).contains(&extra.addr()));
    let s = p.stats();
    assert_eq!((s.slabs, s.cache_misses, s.cache_hits), (2, 2, 1023));
    assert_eq!(s.bytes_registered, 8 * MIB as u64);
}

#[test]
fn class_larger_than_slab_gets_dedicated_slab() {
    let (p, fake) = pool(PoolConfig::new().slab_size(MIB).max_class_size(4 * MIB));
    let a = p.try_alloc(3 * MIB).unwrap();
    let b = p.try_alloc(2 * MIB + 1).unwrap();
    assert_eq!((a.capacity(), b.capacity()), (4 * MIB, 4 * MIB));
    assert_eq!(fake.registrations(), 2);
    assert_eq!(fake.registered_bytes(), 8 * MIB as u64);
    assert_ne!(a.lkey(), b.lkey());
    let a_addr = a.addr();
    drop(a);
    let c = p.try_alloc(4 * MIB).unwrap();
    assert_eq!(c.addr(), a_addr, "the dedicated slab is reused");
    assert_eq!(fake.registrations(), 2);
}

#[test]
fn stats_follow_alloc_free_sequences_exactly() {
    let (p, fake) = pool(PoolConfig::default());
    assert_eq!(p.stats(), PoolStats::default());
    let a = p.try_alloc(100).unwrap(); // miss, 4 KiB slab
    let b = p.try_alloc(4096).unwrap(); // hit
    let c = p.try_alloc(5000).unwrap(); // miss, 8 KiB slab
    let s = p.stats();
    assert_eq!(
        (s.allocations, s.cache_hits, s.cache_misses, s.slabs),
        (3, 1, 2, 2)
    );
    assert_eq!(s.bytes_in_use, 4096 + 4096 + 8192);
    assert_eq!(s.high_water_bytes, 16_384);
    assert_eq!(s.bytes_registered, 8 * MIB as u64);
    drop(a);
    drop(c);
    let s = p.stats();
    assert_eq!((s.bytes_in_use, s.high_water_bytes), (4096, 16_384));
    let d = p.try_alloc(8000).unwrap(); // hit: c's buffer
    let e = p.try_alloc(1).unwrap(); // hit: a's buffer
    let s = p.stats();
    assert_eq!(
        (s.allocations, s.cache_hits, s.cache_misses, s.slabs),
        (5, 3, 2, 2)
    );
    assert_eq!((s.bytes_in_use, s.high_water_bytes), (16_384, 16_384));
    drop((b, d, e));
    let s = p.stats();
    assert_eq!(
        (s.bytes_in_use, s.high_water_bytes, s.waits),
        (0, 16_384, 0)
    );
    assert_eq!(s.bytes_registered, 8 * MIB as u64, "slabs stay registered");
    assert_eq!(fake.deregistrations(), 0);
}

#[test]
fn freeze_is_zero_copy_and_memory_returns_after_last_clone() {
    let (p, _) = pool(PoolConfig::default());
    let mut buf = p.try_alloc(10).unwrap();
    buf.put_slice(b"hello ");
    buf.put_u32(0x0102_0304);
    buf.write_all(b"!").unwrap();
    assert_eq!(buf.as_slice(), b"hello \x01\x02\x03\x04!");
    assert_eq!(buf.remaining_mut(), 4096 - 11);
    let (addr, lkey, rkey) = (buf.addr(), buf.lkey(), buf.rkey());

    let frozen = buf.freeze();
    assert_eq!(frozen.addr(), addr);
    assert_eq!((frozen.lkey(), frozen.rkey()), (lkey, rkey));
    assert_eq!(&frozen[..], b"hello \x01\x02\x03\x04!");
    let tail = frozen.slice(6..);
    assert_eq!(tail.addr(), addr + 6);
    let bytes: Bytes = frozen.clone().into_bytes();
    assert_eq!(bytes.as_ptr() as u64, addr);
    let bytes2 = bytes.clone();
    drop(frozen);
    drop(tail);
    drop(bytes);
    assert_eq!(p.stats().bytes_in_use, 4096, "a Bytes clone is still alive");
    drop(bytes2);
    assert_eq!(p.stats().bytes_in_use, 0);

    // into_bytes directly, and the buffer comes back for the next alloc.
    let mut again = p.try_alloc(1).unwrap();
    assert_eq!(again.addr(), addr);
    again.put_slice(b"xyz");
    let b = again.into_bytes();
    assert_eq!((b.as_ptr() as u64, &b[..]), (addr, &b"xyz"[..]));
    drop(b);
    let s = p.stats();
    assert_eq!((s.bytes_in_use, s.allocations, s.cache_hits), (0, 2, 1));
}

#[test]
fn buffer_fill_in_place_and_limits() {
    let (p, _) = pool(PoolConfig::default());
    let mut buf = p.try_alloc(4096).unwrap();
    buf.spare_mut()[..4].copy_from_slice(b"abcd");
    buf.set_len(4);
    assert_eq!(&buf[..], b"abcd");
    buf.as_mut_slice()[0] = b'z';
    assert_eq!(buf.as_slice(), b"zbcd");
    assert_eq!(buf.write(&[7u8; 5000]).unwrap(), 4092);
    assert_eq!(buf.len(), 4096);
    assert_eq!(buf.write(b"x").unwrap(), 0);
    assert_eq!(buf.remaining_mut(), 0);
    buf.clear();
    assert!(buf.is_empty());
    let full = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| buf.set_len(4097)));
    assert!(full.is_err());
}

#[test]
fn exhausted_error_policy_returns_typed_error() {
    let (p, fake) = error_pool(4 * MIB);
    let bufs: Vec<_> = (0..1024).map(|_| p.try_alloc(4096).unwrap()).collect();
    let err = p.try_alloc(1).unwrap_err();
    assert!(
        matches!(err, PoolError::Exhausted { class: 4096, max_registered_bytes } if max_registered_bytes == 4 * MIB as u64),
        "{err:?}"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let err = rt.block_on(p.alloc(1)).unwrap_err();
    assert!(matches!(err, PoolError::Exhausted { class: 4096, .. }));
    assert_eq!(io::Error::from(err).kind(), io::ErrorKind::OutOfMemory);
    // Another class cannot get a slab while every 4 KiB buffer is in use.
    assert!(matches!(
        p.try_alloc(8192),
        Err(PoolError::Exhausted { class: 8192, .. })
    ));
    assert_eq!(fake.registrations(), 1);
    drop(bufs);
    assert_eq!(p.try_alloc(1).unwrap().capacity(), 4096);
    assert_eq!(p.stats().waits, 0);
}

#[test]
fn try_alloc_never_waits_under_wait_policy() {
    let (p, _) = pool(PoolConfig::new().max_registered_bytes(4 * MIB as u64));
    let _all = p.try_alloc(MIB).unwrap();
    let _b: Vec<_> = (0..3).map(|_| p.try_alloc(MIB).unwrap()).collect();
    assert!(matches!(
        p.try_alloc(MIB),
        Err(PoolError::Exhausted { class, .. }) if class == MIB
    ));
}

#[tokio::test]
async fn waiting_alloc_completes_when_a_buffer_is_dropped() {
    let (p, _) = pool(PoolConfig::new().max_registered_bytes(4 * MIB as u64));
    let mut bufs: Vec<_> = (0..4).map(|_| p.try_alloc(MIB).unwrap()).collect();
    let p2 = p.clone();
    let waiter = tokio::spawn(async move { p2.alloc(MIB).await });
    // Let the waiter run until it is parked (it counts itself in `waits`).
    while p.stats().waits == 0 {
        tokio::task::yield_now().await;
    }
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(!waiter.is_finished(), "no buffer was returned yet");
    let freed = bufs.pop().unwrap();
    let freed_addr = freed.addr();
    drop(freed);
    let got = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter is woken by the drop")
        .unwrap()
        .unwrap();
    assert_eq!(got.addr(), freed_addr);
    let s = p.stats();
    assert_eq!((s.waits, s.allocations, s.slabs), (1, 5, 1));
    assert_eq!(s.bytes_in_use, 4 * MIB as u64);
}

#[tokio::test]
async fn waiting_alloc_is_served_by_reclaiming_another_class() {
    // Only one 4 MiB slab fits; a 1 MiB waiter needs the 4 KiB slab freed.
    let (p, fake) = pool(PoolConfig::new().max_registered_bytes(4 * MIB as u64));
    let small: Vec<_> = (0..1024).map(|_| p.try_alloc(1).unwrap()).collect();
    let p2 = p.clone();
    let waiter = tokio::spawn(async move { p2.alloc(MIB).await });
    while p.stats().waits == 0 {
        tokio::task::yield_now().await;
    }
    let mut small = small;
    small.truncate(1);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(
        !waiter.is_finished(),
        "one 4 KiB buffer still pins its slab"
    );
    drop(small);
    let big = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(big.capacity(), MIB);
    assert_eq!((fake.registrations(), fake.deregistrations()), (2, 1));
    assert_eq!(fake.peak_registered_bytes(), 4 * MIB as u64);
    let s = p.stats();
    assert_eq!((s.slabs, s.slabs_released, s.waits), (1, 1, 1));
}

#[tokio::test]
async fn cancelled_wait_leaves_no_waiter_behind() {
    let (p, _) = pool(PoolConfig::new().max_registered_bytes(4 * MIB as u64));
    let bufs: Vec<_> = (0..4).map(|_| p.try_alloc(MIB).unwrap()).collect();
    let r = tokio::time::timeout(Duration::from_millis(10), p.alloc(MIB)).await;
    assert!(r.is_err());
    assert_eq!(p.inner.waiters.load(Ordering::SeqCst), 0);
    drop(bufs);
    assert_eq!(p.stats().bytes_in_use, 0);
}

#[test]
fn bound_is_never_exceeded_and_free_slabs_are_reclaimed() {
    let (p, fake) = error_pool(8 * MIB);
    // Two 4 KiB slabs fill the bound.
    let small: Vec<_> = (0..2048).map(|_| p.try_alloc(4096).unwrap()).collect();
    assert!(matches!(
        p.try_alloc(8192),
        Err(PoolError::Exhausted { class: 8192, .. })
    ));
    drop(small);
    // All 4 KiB buffers free: one 4 KiB slab is deregistered for the 8 KiB one.
    let a = p.try_alloc(8192).unwrap();
    assert_eq!((fake.registrations(), fake.deregistrations()), (3, 1));
    let b = p.try_alloc(MIB).unwrap();
    assert_eq!((fake.registrations(), fake.deregistrations()), (4, 2));
    assert!(matches!(
        p.try_alloc(65_536),
        Err(PoolError::Exhausted { .. })
    ));
    assert!(fake.peak_registered_bytes() <= 8 * MIB as u64);
    let s = p.stats();
    assert_eq!(s.bytes_registered, fake.registered_bytes());
    assert_eq!((s.slabs, s.slabs_released), (2, 2));
    drop((a, b));
}

#[test]
fn failed_registration_is_reported_and_releases_its_reservation() {
    let (p, fake) = error_pool(4 * MIB);
    fake.set_fail(true);
    let err = p.try_alloc(1).unwrap_err();
    assert!(matches!(err, PoolError::Registration { len, .. } if len == 4 * MIB));
    assert_eq!(io::Error::from(err).kind(), io::ErrorKind::OutOfMemory);
    assert_eq!(p.stats(), PoolStats::default());
    fake.set_fail(false);
    assert!(p.try_alloc(1).is_ok());
}

#[test]
fn invalid_configs_are_rejected() {
    for (cfg, reason) in [
        (PoolConfig::new().min_class_size(3000), "min_class_size"),
        (PoolConfig::new().max_class_size(2048), "max_class_size"),
        (PoolConfig::new().slab_size(3 * MIB), "slab_size"),
        (
            PoolConfig::new().max_registered_bytes(MIB as u64),
            "max_registered_bytes",
        ),
    ] {
        let err = MemoryPool::with_registrar(FakeRegistrar::new(), cfg).unwrap_err();
        assert!(
            matches!(&err, PoolError::InvalidConfig { reason: r } if r.starts_with(reason)),
            "{err:?}"
        );
    }
}

#[test]
fn small_custom_classes() {
    let (p, fake) = pool(
        PoolConfig::new()
            .min_class_size(64)
            .max_class_size(256)
            .slab_size(4096)
            .max_registered_bytes(8192),
    );
    assert_eq!(p.class_size(65).unwrap(), 128);
    let bufs: Vec<_> = (0..64).map(|_| p.try_alloc(64).unwrap()).collect();
    assert!(bufs.iter().all(|b| b.addr() % 64 == 0));
    assert_eq!(fake.registrations(), 1);
    assert!(matches!(
        p.try_alloc(257),
        Err(PoolError::TooLarge {
            len: 257,
            max_class: 256
        })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_tasks_keep_counts_exact() {
    // Four classes would need 16 MiB of slabs; the 8 MiB bound forces waits
    // and reclaims. A task holds no buffer while it allocates (no
    // hold-and-wait), so every allocation eventually succeeds.
    let (p, fake) = pool(PoolConfig::new().max_registered_bytes(8 * MIB as u64));
    let mut tasks = Vec::new();
    for t in 0..8u8 {
        let p = p.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..500usize {
                let len = [1, 5000, 300_000, MIB][(i + t as usize) % 4];
                let mut b = p.alloc(len).await.unwrap();
                let fill = t.wrapping_mul(31).wrapping_add(i as u8);
                b.put_bytes(fill, 64);
                tokio::task::yield_now().await;
                assert!(b.iter().all(|&x| x == fill), "buffer shared by two owners");
                if i % 2 == 0 {
                    let frozen = b.freeze();
                    tokio::task::yield_now().await;
                    assert!(frozen.iter().all(|&x| x == fill));
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("no deadlock")
            .unwrap();
    }
    let s = p.stats();
    assert_eq!(s.allocations, 8 * 500);
    assert_eq!(s.cache_hits + s.cache_misses, 8 * 500);
    assert_eq!(s.bytes_in_use, 0);
    assert!(s.high_water_bytes <= 8 * MIB as u64);
    assert!(fake.peak_registered_bytes() <= 8 * MIB as u64);
    assert_eq!(s.bytes_registered, fake.registered_bytes());
    assert_eq!(
        fake.registrations() - fake.deregistrations(),
        s.slabs,
        "{s:?}"
    );
    assert_eq!(s.slabs_released, fake.deregistrations());
    assert_eq!(p.inner.waiters.load(Ordering::SeqCst), 0);
    eprintln!("concurrent: {s:?}");
}

#[test]
fn stats_return_to_baseline_and_teardown_waits_for_last_buffer() {
    let (p, fake) = pool(PoolConfig::default());
    let baseline = p.stats();
    let a = p.try_alloc(1).unwrap().freeze();
    let b = p.try_alloc(MIB).unwrap().into_bytes();
    let c = p.try_alloc(70_000).unwrap();
    drop(c);
    let a2 = a.clone();
    drop(a);
    assert_eq!(p.stats().bytes_in_use, 4096 + MIB as u64);
    drop(a2);
    drop(b);
    let s = p.stats();
    assert_eq!(s.bytes_in_use, baseline.bytes_in_use);
    assert_eq!(
        (s.allocations, s.high_water_bytes),
        (3, 4096 + MIB as u64 + 131_072)
    );

    // The pool goes away while a Bytes still points into a slab: nothing is
    // deregistered until it drops, then every slab is.
    let keep = p.try_alloc(1).unwrap().into_bytes();
    drop(p);
    assert_eq!(fake.deregistrations(), 0);
    assert_eq!(&keep[..], b"");
    drop(keep);
    assert_eq!(fake.deregistrations(), 3);
    assert_eq!(fake.registered_bytes(), 0);
}

#[test]
fn registered_regions_from_vec_bytes_and_static() {
    static DATA: [u8; 5] = *b"hello";
    let (p, fake) = pool(PoolConfig::default());
    let v = p.register_vec(vec![9u8; 1000]).unwrap();
    assert_eq!((v.len(), &v[..3]), (1000, &[9u8, 9, 9][..]));
    assert_eq!((v.lkey(), v.rkey()), (0x1000_0001, 0x2000_0001));

    let bytes = Bytes::from(vec![1u8, 2, 3]);
    let r1 = p.register_bytes(bytes.clone()).unwrap();
    assert_eq!(r1.addr(), bytes.as_ptr() as u64);
    let r2 = p.register_bytes(bytes.clone()).unwrap();
    assert_eq!((r2.lkey(), r2.addr()), (r1.lkey(), r1.addr()), "cache hit");
    let other_len = p.register_bytes(bytes.slice(0..2)).unwrap();
    assert_ne!(other_len.lkey(), r1.lkey());

    let s1 = p.register_static(&DATA).unwrap();
    let s2 = p.register_static(&DATA).unwrap();
    assert_eq!(s1.addr(), DATA.as_ptr() as u64);
    assert_eq!((&s1[..], s1.lkey()), (&b"hello"[..], s2.lkey()));
    assert_eq!(fake.registrations(), 4);
    let s = p.stats();
    assert_eq!((s.regions, s.region_cache_hits), (4, 2));
    assert_eq!(s.bytes_registered, 0, "user memory is not pool memory");

    // Zero-copy Bytes from a region keep the registration alive.
    let as_bytes = s1.clone().into_bytes();
    assert_eq!(as_bytes.as_ptr(), DATA.as_ptr());
    drop((s1, s2));
    assert_eq!(fake.deregistrations(), 0);
    drop(as_bytes);
    assert_eq!(fake.deregistrations(), 1);
    // Dead cache entries are gone: a new static registration registers again.
    let s3 = p.register_static(&DATA).unwrap();
    assert_eq!(fake.registrations(), 5);
    drop((v, r1, r2, other_len, s3));
    assert_eq!(fake.deregistrations(), 5);
    assert_eq!(p.stats().regions, 0);
    assert!(lock(&p.inner.region_cache).is_empty());

    assert!(matches!(
        p.register_vec(Vec::new()),
        Err(PoolError::EmptyRegion)
    ));
    assert!(matches!(
        p.register_bytes(Bytes::new()),
        Err(PoolError::EmptyRegion)
    ));
    fake.set_fail(true);
    assert!(matches!(
        p.register_static(&DATA),
        Err(PoolError::Registration { len: 5, .. })
    ));
}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync + 'static>() {}
    check::<MemoryPool>();
    check::<PoolBuf>();
    check::<PoolBytes>();
    check::<RegisteredRegion>();
    fn alloc_is_send(p: &MemoryPool) -> impl Send + '_ {
        p.alloc(1)
    }
    let (p, _) = pool(PoolConfig::default());
    drop(alloc_is_send(&p));
}

#[test]
fn alloc_any_serves_messages_beyond_the_largest_class_with_a_dedicated_region() {
    let (p, fake) = error_pool(16 * MIB);
    let small = p.try_alloc_any(100).unwrap();
    assert_eq!(
        small.capacity(),
        4096,
        "a class buffer up to the largest class"
    );
    let big = p.try_alloc_any(3 * MIB + 5).unwrap();
    assert_eq!(big.capacity(), 3 * MIB + 5, "exactly the requested length");
    assert_eq!(big.addr() % 4096, 0);
    assert_eq!(fake.registrations(), 2);
    let s = p.stats();
    // The 4 KiB class slab (4 MiB) plus the page-rounded dedicated region.
    let dedicated = (3 * MIB + 4096) as u64;
    assert_eq!(s.bytes_registered, 4 * MIB as u64 + dedicated);
    assert_eq!(s.bytes_in_use, 4096 + dedicated);
    assert_eq!((s.allocations, s.cache_misses, s.slabs), (2, 2, 2));
    assert!(p.owns(big.as_ptr(), 0));
    let full = full_range(&big);
    assert!(
        p.owns(full.0, full.1),
        "the whole buffer lies in a live slab"
    );
    assert!(!p.owns(full.0, full.1 + 4097), "but not beyond it");
    drop(big);
    assert_eq!(fake.deregistrations(), 1, "dropping it deregisters at once");
    let s = p.stats();
    assert_eq!(s.bytes_registered, 4 * MIB as u64);
    assert_eq!(s.bytes_in_use, 4096);
    assert_eq!(s.slabs, 1);
    assert!(!p.owns(full.0, 1), "a freed region is no longer owned");
    // Beyond the bound: can never be served.
    let err = p.try_alloc_any(17 * MIB).unwrap_err();
    assert!(matches!(err, PoolError::TooLarge { .. }), "{err:?}");
    // Within the bound but not now: exhausted (Error policy), nothing kept.
    let err = p.try_alloc_any(13 * MIB).unwrap_err();
    assert!(matches!(err, PoolError::Exhausted { .. }), "{err:?}");
    assert_eq!(p.stats().bytes_registered, 4 * MIB as u64);
    drop(small);
    // The free 4 KiB slab is released to make room.
    let huge = p.try_alloc_any(13 * MIB).unwrap();
    assert_eq!(huge.capacity(), 13 * MIB);
    assert_eq!(p.stats().slabs_released, 1);
    drop(huge);
    assert_eq!(p.stats().bytes_registered, 0);
    assert_eq!(p.stats().bytes_in_use, 0);
}

/// Start and capacity of a buffer (its full registered range).
fn full_range(b: &PoolBuf) -> (*const u8, usize) {
    (b.addr() as *const u8, b.capacity())
}

#[tokio::test]
async fn alloc_any_waits_for_a_dedicated_region_to_fit() {
    let (p, _) = pool(PoolConfig::new().max_registered_bytes(8 * MIB as u64));
    let first = p.alloc_any(5 * MIB).await.unwrap();
    let p2 = p.clone();
    let waiter = tokio::spawn(async move { p2.alloc_any(5 * MIB).await.map(|b| b.capacity()) });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "5 + 5 MiB exceed the 8 MiB bound");
    drop(first);
    let cap = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("served once the first region is freed")
        .unwrap()
        .unwrap();
    assert_eq!(cap, 5 * MIB);
}

#[test]
fn owns_rejects_memory_outside_every_slab() {
    let (p, _) = pool(PoolConfig::default());
    let b = p.try_alloc(10).unwrap();
    let outside = [0u8; 64];
    assert!(!p.owns(outside.as_ptr(), outside.len()));
    assert!(p.owns(b.addr() as *const u8, b.capacity()));
    assert!(!p.owns(b.addr() as *const u8, usize::MAX));
}

/// Memory of the caller's that records when it is dropped and how many
/// registrations were dropped by then.
struct Tracked {
    bytes: Box<[u8]>,
    dropped: std::sync::Arc<std::sync::Mutex<Option<u64>>>,
    fake: FakeRegistrar,
}

impl AsMut<[u8]> for Tracked {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        *self.dropped.lock().unwrap() = Some(self.fake.deregistrations());
    }
}

#[test]
fn register_local_owns_the_memory_and_gives_it_back_with_what_was_written() {
    let (p, fake) = pool(PoolConfig::default());
    let v: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
    let expect = v.clone();
    let ptr = v.as_ptr() as u64;
    let r = p.register_local(v).unwrap();
    assert_eq!((r.len(), r.addr()), (1000, ptr), "no copy, no move");
    assert_eq!(fake.last_access(), Some(Access::ReadWrite));
    assert_eq!((fake.registrations(), p.stats().regions), (1, 1));
    assert!(r.usable_with(&p));
    let (other, _) = pool(PoolConfig::default());
    assert!(!r.usable_with(&other), "another pool's PD");

    r.write_at(998, &[7, 8]).unwrap();
    let mut head = [0u8; 3];
    r.read_at(0, &mut head).unwrap();
    assert_eq!(head, [0, 1, 2]);
    let e = r.write_at(999, &[1, 2]).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);

    // Held by a clone: refused, unchanged.
    let clone = r.clone();
    let r = r.try_into_memory::<Vec<u8>>().unwrap_err();
    drop(clone);
    // Not a `Box<[u8]>`: refused, still registered.
    let r = r.try_into_memory::<Box<[u8]>>().unwrap_err();
    assert_eq!((fake.deregistrations(), r.addr()), (0, ptr));
    let back: Vec<u8> = r.try_into_memory().unwrap();
    assert_eq!((back.len(), back.as_ptr() as u64), (1000, ptr));
    assert_eq!(back[..998], expect[..998]);
    assert_eq!(back[998..], [7, 8]);
    assert_eq!((fake.deregistrations(), p.stats().regions), (1, 0));

    // A pool buffer's region has no memory of the caller's to give back.
    let buf = p.try_alloc(100).unwrap();
    let pooled = crate::remote::LocalRegion::new(buf);
    assert!(pooled.usable_with(&p) && !pooled.usable_with(&other));
    let pooled = pooled.try_into_memory::<Vec<u8>>().unwrap_err();
    assert_eq!(pooled.len(), 4096);
}

#[test]
fn register_local_deregisters_before_freeing_and_frees_on_failure() {
    let (p, fake) = pool(PoolConfig::default());
    let dropped = std::sync::Arc::new(std::sync::Mutex::new(None));
    let tracked = |n: usize| Tracked {
        bytes: vec![3u8; n].into_boxed_slice(),
        dropped: dropped.clone(),
        fake: fake.clone(),
    };
    let r = p.register_local(tracked(64)).unwrap();
    drop(r);
    assert_eq!(
        *dropped.lock().unwrap(),
        Some(1),
        "freed after deregistration"
    );
    assert_eq!(p.stats().regions, 0);

    *dropped.lock().unwrap() = None;
    assert!(matches!(
        p.register_local(tracked(0)),
        Err(PoolError::EmptyRegion)
    ));
    assert_eq!(*dropped.lock().unwrap(), Some(1), "an empty one is dropped");
    *dropped.lock().unwrap() = None;
    fake.set_fail(true);
    assert!(matches!(
        p.register_local(tracked(64)),
        Err(PoolError::Registration { len: 64, .. })
    ));
    assert_eq!(
        *dropped.lock().unwrap(),
        Some(1),
        "a refused one is dropped"
    );
    assert_eq!((fake.registrations(), p.stats().regions), (1, 0));
}

#[test]
fn register_local_keeps_inline_memory_in_place_and_checks_word_alignment() {
    let (p, _fake) = pool(PoolConfig::default());
    // An array lives inline in its value: boxed, it does not move.
    let r = p.register_local([5u8; 64]).unwrap();
    let addr = r.addr();
    let moved = vec![r.clone()];
    assert_eq!(moved[0].addr(), addr);
    let mut all = [0u8; 64];
    r.read_at(0, &mut all).unwrap();
    assert_eq!(all, [5u8; 64]);
    r.write_at(0, &[0u8; 64]).unwrap();
    // Words are read where the address, not the offset, is aligned.
    let first = (8 - (addr % 8) as usize) % 8;
    r.write_at(first, &0x0102_0304_0506_0708u64.to_ne_bytes())
        .unwrap();
    assert_eq!(r.load_u64(first).unwrap(), 0x0102_0304_0506_0708);
    let e = r.load_u64(first + 1).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    let past = first + 8 * ((64 - first) / 8); // the first aligned word not inside
    assert_eq!(r.load_u64(past - 8).unwrap(), 0);
    let e = r.load_u64(past).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "past the end");
    drop(moved);
    let back: [u8; 64] = r.try_into_memory().unwrap();
    assert_eq!(
        back[first..first + 8],
        0x0102_0304_0506_0708u64.to_ne_bytes()
    );

    let b = bytes::BytesMut::from(&b"remote memory"[..]);
    let r = p.register_local(b).unwrap();
    r.write_at(0, b"R").unwrap();
    let back: bytes::BytesMut = r.try_into_memory().unwrap();
    assert_eq!(&back[..], b"Remote memory");
}
