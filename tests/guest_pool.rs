//! Guest test of the registered memory pool and user-memory regions on a
//! real verbs stack (needs the Soft-RoCE guest: `integration/softroce run --
//! ...`). Fails, never skips, without a device.
//!
//! Compiled only with `--cfg tokio_rdma_guest` (`scripts/test` sets it), so
//! host builds (`cargo test --all-features` included) leave it empty.
#![cfg(tokio_rdma_guest)]

use std::collections::HashSet;
use std::io;
use std::time::Duration;

use bytes::{BufMut as _, Bytes};
use tokio_rdma::pool::{ExhaustedPolicy, MemoryPool, PoolBuf, PoolConfig, PoolError};

const MIB: usize = 1024 * 1024;

fn rxe_pool(max: usize, policy: ExhaustedPolicy) -> MemoryPool {
    MemoryPool::for_device(
        "rxe0",
        PoolConfig::new()
            .max_registered_bytes(max as u64)
            .exhausted_policy(policy),
    )
    .expect("rxe0 must exist in the Soft-RoCE guest")
}

#[test]
fn pool_on_rxe0_hands_out_buffers_with_real_keys_per_slab() {
    let pool = rxe_pool(16 * MIB, ExhaustedPolicy::Error);
    let first: Vec<PoolBuf> = (0..1024).map(|_| pool.try_alloc(4096).unwrap()).collect();
    let second = pool.try_alloc(1).unwrap();
    // The slabs' own rkeys open nothing (no remote access; rxe reports 0
    // for such an MR): peers reach a buffer only through a memory window.
    let (lkey, rkey) = (first[0].lkey(), first[0].rkey());
    assert_ne!(lkey, 0);
    assert!(first.iter().all(|b| (b.lkey(), b.rkey()) == (lkey, rkey)));
    assert_ne!(second.lkey(), 0);
    assert_ne!(second.lkey(), lkey, "each slab is its own MR");
    let addrs: HashSet<u64> = first.iter().map(|b| b.addr()).collect();
    assert_eq!(addrs.len(), 1024);
    assert!(addrs.iter().all(|a| a % 4096 == 0));
    let s = pool.stats();
    assert_eq!(
        (s.allocations, s.cache_hits, s.cache_misses, s.slabs),
        (1025, 1023, 2, 2)
    );
    assert_eq!(s.bytes_registered, 8 * MIB as u64);
    assert_eq!(s.bytes_in_use, 1025 * 4096);
    println!(
        "rxe0 slab keys: lkey {lkey:#x} rkey {rkey:#x}; second slab lkey {:#x} rkey {:#x}",
        second.lkey(),
        second.rkey()
    );
    let second_keys = (second.lkey(), second.rkey());
    drop(first);
    drop(second);

    let mut buf = pool.try_alloc(100).unwrap();
    buf.put_slice(b"registered payload");
    let addr = buf.addr();
    // The free list is LIFO: the buffer dropped last (of the second slab)
    // comes back first.
    assert_eq!((buf.lkey(), buf.rkey()), second_keys);
    let frozen = buf.freeze();
    let bytes: Bytes = frozen.clone().into_bytes();
    assert_eq!(bytes.as_ptr() as u64, addr);
    assert_eq!(&bytes[..], b"registered payload");
    assert_eq!((frozen.lkey(), frozen.rkey()), second_keys);
    drop(frozen);
    assert_eq!(pool.stats().bytes_in_use, 4096);
    drop(bytes);
    let s = pool.stats();
    assert_eq!(
        (s.bytes_in_use, s.allocations, s.cache_hits),
        (0, 1026, 1024)
    );
    assert_eq!(s.high_water_bytes, 1025 * 4096);
}

#[test]
fn exhaustion_and_reclaim_on_rxe0() {
    let pool = rxe_pool(8 * MIB, ExhaustedPolicy::Error);
    let small: Vec<_> = (0..2048).map(|_| pool.try_alloc(1).unwrap()).collect();
    let err = pool.try_alloc(8192).unwrap_err();
    assert!(
        matches!(err, PoolError::Exhausted { class: 8192, max_registered_bytes } if max_registered_bytes == 8 * MIB as u64),
        "{err:?}"
    );
    assert_eq!(io::Error::from(err).kind(), io::ErrorKind::OutOfMemory);
    drop(small);
    let big = pool.try_alloc(8192).unwrap();
    assert_ne!(big.lkey(), 0);
    let s = pool.stats();
    assert_eq!(
        (s.slabs, s.slabs_released, s.bytes_registered),
        (2, 1, 8 * MIB as u64)
    );
    drop(big);
    assert_eq!(pool.stats().bytes_in_use, 0);
}

#[test]
fn waiting_alloc_on_rxe0_completes_when_a_buffer_drops() {
    let pool = rxe_pool(4 * MIB, ExhaustedPolicy::Wait);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut held: Vec<_> = (0..4).map(|_| pool.try_alloc(MIB).unwrap()).collect();
        let p2 = pool.clone();
        let waiter = tokio::spawn(async move { p2.alloc(MIB).await });
        while pool.stats().waits == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!waiter.is_finished());
        let back = held.pop().unwrap();
        let addr = back.addr();
        drop(back);
        let got = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("woken by the drop")
            .unwrap()
            .unwrap();
        assert_eq!(got.addr(), addr);
        let s = pool.stats();
        assert_eq!((s.waits, s.allocations, s.slabs), (1, 5, 1));
    });
}

#[test]
fn registered_regions_on_rxe0_from_vec_bytes_and_static() {
    // In .rodata: only a registration without write or MW_BIND can pin it.
    static DATA: &[u8] = b"static payload, registered read-only";
    let pool = rxe_pool(16 * MIB, ExhaustedPolicy::Error);
    let v = pool.register_vec(vec![0xAB; 3 * MIB]).unwrap();
    let b = Bytes::from((0..=255u8).cycle().take(MIB + 7).collect::<Vec<u8>>());
    let rb = pool.register_bytes(b.clone()).unwrap();
    let rb2 = pool.register_bytes(b.clone()).unwrap();
    let rs = pool.register_static(DATA).unwrap();
    for (name, r) in [("vec", &v), ("bytes", &rb), ("static", &rs)] {
        assert_ne!(r.lkey(), 0, "{name}");
    }
    // Writable memory can take memory windows; read-only pages cannot (the
    // kernel pins MW_BIND memory writable), so a static region is
    // registered for local reads only.
    assert!(v.can_bind_windows());
    assert!(rb.can_bind_windows());
    assert!(!rs.can_bind_windows());
    let lkeys: HashSet<u32> = [v.lkey(), rb.lkey(), rs.lkey()].into();
    assert_eq!(lkeys.len(), 3);
    assert_eq!((rb2.lkey(), rb2.rkey()), (rb.lkey(), rb.rkey()), "cached");
    assert_eq!(rb.addr(), b.as_ptr() as u64);
    assert_eq!(rs.addr(), DATA.as_ptr() as u64);
    assert_eq!((v.len(), v[3 * MIB - 1]), (3 * MIB, 0xAB));
    assert_eq!(&rb[..], &b[..]);
    assert_eq!(&rs[..], DATA);
    let s = pool.stats();
    assert_eq!(
        (s.regions, s.region_cache_hits, s.bytes_registered),
        (3, 1, 0)
    );
    let static_bytes = rs.clone().into_bytes();
    assert_eq!(static_bytes.as_ptr(), DATA.as_ptr());
    drop((v, rb, rb2, rs));
    assert_eq!(pool.stats().regions, 1, "the Bytes keeps the static region");
    drop(static_bytes);
    assert_eq!(pool.stats().regions, 0);
    // Registering again after everything dropped makes a fresh MR.
    let again = pool.register_bytes(b).unwrap();
    assert_ne!(again.lkey(), 0);
    assert_eq!(pool.stats().region_cache_hits, 1);
}

#[test]
fn unknown_device_is_a_typed_error() {
    let err = MemoryPool::for_device("no_such_dev", PoolConfig::new()).unwrap_err();
    assert!(matches!(err, PoolError::Device(_)), "{err:?}");
    assert_eq!(io::Error::from(err).kind(), io::ErrorKind::NotFound);
}
