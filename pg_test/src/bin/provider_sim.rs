//! `provider-sim`: the provider simulator as a standalone process, for the demo and for
//! poking at the extension by hand.
//!
//! ```text
//! provider-sim [--port 8788] [--dedupe-header Idempotency-Key]
//!              [--random drop=0.05,503=0.05,429=0.02,retry_after=1,seed=7 | --answer-bytes N
//!               | --answer-after-ms N]
//!              [--no-record-bodies] [--no-record-requests] [--quiet]
//! ```
//!
//! Every channel gets the default given on the command line (`Accept`, the random faults,
//! or with `--answer-bytes N` `AcceptLarge(N)`: accepts answered with a JSON body of `N`
//! bytes, the id first, for the response-size benchmarks; with `--answer-after-ms N`
//! `AcceptAfter(N ms)`: a slow provider, for the benchmarks of connection slots). Prints
//! `listening on 127.0.0.1:PORT` first (flushed, so scripts can wait for it), then one
//! line per request unless `--quiet`, and runs until SIGTERM or SIGINT.
//! `GET /_stats` and `GET /_requests?channel=X` show what it has seen.

use std::io::Write as _;
use std::process::ExitCode;

use outbox_e2e::sim::{Action, RandomFaults, Received, Simulator};

const USAGE: &str = "usage: provider-sim [--port PORT] [--dedupe-header NAME] \
[--random drop=P,503=P,429=P,retry_after=S,seed=N | --answer-bytes N | --answer-after-ms N] [--no-record-bodies] \
[--no-record-requests] [--quiet]";

struct Args {
    port: u16,
    dedupe_header: Option<String>,
    random: Option<RandomFaults>,
    /// `--answer-bytes N`: the default is `AcceptLarge(N)`.
    answer_bytes: Option<usize>,
    /// `--answer-after-ms N`: the default is `AcceptAfter(N ms)`.
    answer_after_ms: Option<u64>,
    record_bodies: bool,
    record_requests: bool,
    quiet: bool,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut a = Args {
        port: 8788,
        dedupe_header: None,
        random: None,
        answer_bytes: None,
        answer_after_ms: None,
        record_bodies: true,
        record_requests: true,
        quiet: false,
    };
    while let Some(arg) = it.next() {
        // Both `--flag value` and `--flag=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it.next().ok_or_else(|| format!("{name} needs a value")),
            }
        };
        match flag.as_str() {
            "--port" => {
                let v = value("--port")?;
                a.port = v
                    .parse()
                    .map_err(|_| format!("--port: not a port: {v:?}"))?;
            }
            "--dedupe-header" => {
                let v = value("--dedupe-header")?;
                if v.is_empty() {
                    return Err("--dedupe-header: empty header name".into());
                }
                a.dedupe_header = Some(v);
            }
            "--random" => {
                let v = value("--random")?;
                a.random = Some(RandomFaults::parse(&v).map_err(|e| format!("--random: {e}"))?);
            }
            "--answer-bytes" => {
                let v = value("--answer-bytes")?;
                a.answer_bytes = Some(
                    v.parse()
                        .map_err(|_| format!("--answer-bytes: not a byte count: {v:?}"))?,
                );
            }
            "--answer-after-ms" => {
                let v = value("--answer-after-ms")?;
                a.answer_after_ms = Some(
                    v.parse()
                        .map_err(|_| format!("--answer-after-ms: not a count of ms: {v:?}"))?,
                );
            }
            "--no-record-bodies" => a.record_bodies = false,
            "--no-record-requests" => a.record_requests = false,
            "--quiet" | "-q" => a.quiet = true,
            "--help" | "-h" => return Ok(None),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let defaults = [
        a.random.is_some(),
        a.answer_bytes.is_some(),
        a.answer_after_ms.is_some(),
    ];
    if defaults.iter().filter(|d| **d).count() > 1 {
        return Err(
            "--random, --answer-bytes and --answer-after-ms are exclusive (each sets the default)"
                .into(),
        );
    }
    Ok(Some(a))
}

fn log_line(r: &Received) -> String {
    let status = r
        .status
        .map_or_else(|| "---".to_string(), |s| s.to_string());
    let mut line = format!(
        "{} {} key={} -> {} {}",
        r.method,
        r.path,
        r.key.as_deref().unwrap_or("-"),
        status,
        r.outcome
    );
    if let Some(id) = &r.external_id {
        line.push_str(" id=");
        line.push_str(id);
    }
    line
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("provider-sim: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let sim = match Simulator::try_start_on(args.port) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "provider-sim: cannot listen on 127.0.0.1:{}: {e}",
                args.port
            );
            return ExitCode::FAILURE;
        }
    };
    sim.set_record_bodies(args.record_bodies);
    sim.set_record_requests(args.record_requests);
    if let Some(h) = &args.dedupe_header {
        sim.set_dedupe_all(h);
    }
    if let Some(r) = args.random {
        sim.set_default_all(Action::Random(r));
    }
    if let Some(n) = args.answer_bytes {
        sim.set_default_all(Action::AcceptLarge(n));
    }
    if let Some(ms) = args.answer_after_ms {
        sim.set_default_all(Action::AcceptAfter(std::time::Duration::from_millis(ms)));
    }
    if !args.quiet {
        sim.set_observer(|r| {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", log_line(r));
            let _ = out.flush();
        });
    }
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on 127.0.0.1:{}", sim.port());
        let _ = out.flush();
    }

    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("provider-sim: cannot start the signal runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let res: std::io::Result<()> = rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        Ok(())
    });
    if let Err(e) = res {
        eprintln!("provider-sim: cannot wait for signals: {e}");
        return ExitCode::FAILURE;
    }
    sim.shutdown();
    let c = sim.counters();
    eprintln!(
        "provider-sim: stopped after {} sends ({} accepted, {} deduped, {} status errors, {} dropped, {} hung), {} lookups",
        c.sends, c.accepted, c.deduped, c.status_errors, c.dropped, c.hangs, c.lookups
    );
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Result<Option<Args>, String> {
        parse_args(s.split_whitespace().map(str::to_string))
    }

    #[test]
    fn parses_flags() {
        let a = args("--port 9001 --dedupe-header Idempotency-Key --random drop=0.05,503=0.05,429=0.02,retry_after=1,seed=7 --no-record-bodies --quiet")
            .unwrap()
            .unwrap();
        assert_eq!(a.port, 9001);
        assert_eq!(a.dedupe_header.as_deref(), Some("Idempotency-Key"));
        let r = a.random.unwrap();
        assert_eq!(
            (r.drop_after_read_store, r.status_503, r.status_429),
            (0.05, 0.05, 0.02)
        );
        assert_eq!((r.retry_after_s, r.seed), (1, 7));
        assert!(!a.record_bodies && a.record_requests && a.quiet);
        assert_eq!(args("--port=0").unwrap().unwrap().port, 0);
        assert!(args("--help").unwrap().is_none());
        assert!(args("--port").is_err());
        assert!(args("--port x").is_err());
        assert!(args("--bogus").is_err());
        assert!(args("--random drop=2").is_err());
        assert_eq!(args("--port 1").unwrap().unwrap().answer_bytes, None);
    }

    #[test]
    fn parses_answer_bytes() {
        let a = args("--answer-bytes 10000000 --quiet").unwrap().unwrap();
        assert_eq!(a.answer_bytes, Some(10_000_000));
        assert!(a.random.is_none() && a.quiet);
        assert_eq!(
            args("--answer-bytes=4096").unwrap().unwrap().answer_bytes,
            Some(4096)
        );
        assert!(args("--answer-bytes").is_err());
        assert!(args("--answer-bytes -1").is_err());
        assert!(args("--answer-bytes 10MB").is_err());
        assert!(args("--answer-bytes 100 --random drop=0.1").is_err());
    }

    #[test]
    fn parses_answer_after_ms() {
        let a = args("--answer-after-ms 20 --quiet").unwrap().unwrap();
        assert_eq!(a.answer_after_ms, Some(20));
        assert_eq!(args("--port 1").unwrap().unwrap().answer_after_ms, None);
        assert!(args("--answer-after-ms").is_err());
        assert!(args("--answer-after-ms -5").is_err());
        assert!(args("--answer-after-ms 20ms").is_err());
        assert!(args("--answer-after-ms 20 --answer-bytes 100").is_err());
        assert!(args("--answer-after-ms 20 --random drop=0.1").is_err());
    }
}
