//! What signing a request costs the worker, in CPU time of this thread per message: the
//! Standard Webhooks signature (`webhook-id`, `webhook-timestamp`, `webhook-signature`)
//! exactly as the worker adds it to a request (`Signing::sign`), for one and two secrets
//! and bodies of 100 bytes, 1 KiB and 64 KiB. Thread CPU time does not count the time the
//! machine spends on other processes, so the figure holds on a loaded machine too.
//! `bench/bench_webhooks.sh` sets it beside the worker CPU per delivery of its drains.
//!
//! Run: `cargo bench --bench signing`

use outbox_delivery::channels::signing::Signing;
use serde_json::json;
use std::hint::black_box;

/// CPU time of the calling thread, in nanoseconds.
fn thread_cpu_ns() -> u128 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u128 * 1_000_000_000 + t.tv_nsec as u128
}

/// Nanoseconds of CPU per `sign` call, the median of five runs of `n` calls.
fn ns_per_signature(signing: &Signing, body: &[u8], n: u32) -> f64 {
    let mut runs: Vec<f64> = (0..5)
        .map(|run: u32| {
            let started = thread_cpu_ns();
            for i in 0..n {
                let mut headers =
                    vec![("Content-Type".to_string(), "application/json".to_string())];
                signing.sign(
                    &mut headers,
                    black_box("ok_4f1c2a7e9b3d8e60_send"),
                    black_box(1_764_600_000 + u64::from(i) + u64::from(run)),
                    black_box(body),
                );
                black_box(&headers);
            }
            (thread_cpu_ns() - started) as f64 / f64::from(n)
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}

fn main() {
    let secrets = [
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
    ];
    let one = Signing::from_json(&json!({"secrets": &secrets[..1]})).expect("one secret");
    let two = Signing::from_json(&json!({"secrets": secrets})).expect("two secrets");
    for (size, label) in [(100, "100B"), (1024, "1KiB"), (65536, "64KiB")] {
        let body = vec![b'x'; size];
        let n = if size > 4096 { 5_000 } else { 200_000 };
        for (secrets, signing) in [(1, &one), (2, &two)] {
            let ns = ns_per_signature(signing, &body, n);
            println!(
                "signing_cpu_ns_per_message_{label}_{secrets}_secret{} {ns:.0} ns (thread CPU, median of 5 runs of {n})",
                if secrets > 1 { "s" } else { "" }
            );
        }
    }
}
