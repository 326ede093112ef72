use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Store};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;
fn main() {
    let url = std::env::args().nth(1).unwrap();
    let n: u64 = std::env::args().nth(2).unwrap().parse().unwrap();
    let store = Arc::new(
        Store::connect(
            &url,
            Config::new()
                .postgres_schema("pgstats")
                .sweep_interval(None),
        )
        .unwrap(),
    );
    let have = store.stats().unwrap().records.total();
    println!("have {have}");
    let run = |stop: Arc<AtomicBool>, target: u64, tag: &'static str| {
        let count = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..16)
            .map(|t| {
                let (store, stop, count) = (store.clone(), stop.clone(), count.clone());
                std::thread::spawn(move || {
                    let fp = Fingerprint::of(b"p");
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) && count.load(Ordering::Relaxed) < target {
                        let k = Key::new("s", format!("{tag}-{t}-{i}")).unwrap();
                        i += 1;
                        if let ClaimOutcome::Acquired(l) =
                            store.claim(&k, &fp, &ClaimOptions::new()).unwrap()
                        {
                            store.complete(&l, &[7u8; 64]).unwrap();
                        }
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        (hs, count)
    };
    if have < n {
        let t = Instant::now();
        let (hs, _) = run(Arc::new(AtomicBool::new(false)), n - have, "fill");
        for h in hs {
            h.join().unwrap();
        }
        println!("filled {} in {:.1}s", n - have, t.elapsed().as_secs_f64());
    }
    for _ in 0..3 {
        let t = Instant::now();
        let s = store.stats().unwrap();
        println!(
            "idle stats {} ms total {}",
            t.elapsed().as_millis(),
            s.records.total()
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (hs, count) = run(stop.clone(), u64::MAX, "load");
    std::thread::sleep(std::time::Duration::from_secs(2));
    for _ in 0..5 {
        let c0 = count.load(Ordering::Relaxed);
        let t = Instant::now();
        let s = store.stats().unwrap();
        let el = t.elapsed();
        println!(
            "loaded stats {} ms total {} (lifecycles/s meanwhile {:.0})",
            el.as_millis(),
            s.records.total(),
            (count.load(Ordering::Relaxed) - c0) as f64 / el.as_secs_f64()
        );
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
}
