//! `/metrics` over HTTP: `outbox.metrics_address` served by a background worker of its own,
//! scraped by a real Prometheus (Debian's `prometheus`, started here on a loopback port),
//! whose HTTP API then answers for `outbox_queued` and a counter rate; the alert rules of
//! `docs/prometheus-rules.yml` pass `promtool check rules`. A server serving several
//! databases answers one scrape with every database's figures, and says which are missing.

use outbox_e2e::cluster::{unique, wait_until, Cluster, OwnCluster};
use outbox_e2e::helpers::{cluster_and_sim, count, create_channel, enqueue};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A port from `var`, or a free loopback port.
fn port(var: &str) -> u16 {
    std::env::var(var)
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port")
        })
}

/// `GET http://127.0.0.1:port{path}`: status and body.
fn get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// The server with `outbox.metrics_address` set; set back and restarted when dropped.
struct MetricsOn<'a> {
    cluster: &'a Cluster,
}

impl<'a> MetricsOn<'a> {
    fn new(cluster: &'a Cluster, address: &str) -> Self {
        let mut c = cluster.connect();
        c.batch_execute(&format!(
            "ALTER SYSTEM SET outbox.metrics_address = '{address}'"
        ))
        .unwrap();
        cluster.script(&["restart", "fast"]);
        MetricsOn { cluster }
    }
}

impl Drop for MetricsOn<'_> {
    fn drop(&mut self) {
        let mut c = self.cluster.connect();
        let _ = c.batch_execute("ALTER SYSTEM RESET outbox.metrics_address");
        self.cluster.script(&["restart", "fast"]);
    }
}

/// Prometheus on `port` scraping `target` every second; killed when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Prometheus {
    fn start(port: u16, target: &str) -> Prometheus {
        let dir = std::env::temp_dir().join(unique("outbox_prometheus"));
        std::fs::create_dir_all(&dir).unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [{rules:?}]\nscrape_configs:\n  - job_name: outbox\n    static_configs:\n      - targets: [{target:?}]\n",
            rules = repo().join("docs/prometheus-rules.yml").display().to_string()
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .expect("start prometheus (Debian package prometheus; scripts/setup.sh installs it)");
        Prometheus { child, port, dir }
    }

    /// The result vector of an instant query.
    fn query(&self, q: &str) -> Vec<serde_json::Value> {
        let encoded: String = q
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        let Ok((200, body)) = get(self.port, &format!("/api/v1/query?query={encoded}")) else {
            return Vec::new();
        };
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn the_alert_rules_pass_promtool() {
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(repo().join("docs/prometheus-rules.yml"))
        .output()
        .expect("run promtool (Debian package prometheus)");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "promtool check rules: {text}");
    assert!(text.contains("SUCCESS: 9 rules found"), "{text}");
}

/// A heading's anchor as GitHub makes it: lower case, spaces to hyphens, other punctuation
/// dropped.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_alert_rule_links_to_a_runbook_section_that_exists() {
    let rules = std::fs::read_to_string(repo().join("docs/prometheus-rules.yml")).unwrap();
    let runbook = std::fs::read_to_string(repo().join("docs/runbook.md")).unwrap();
    let anchors: Vec<String> = runbook
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| anchor_of(l.trim_start_matches('#')))
        .collect();
    let mut alert = None;
    let mut linked = 0;
    for line in rules.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            assert!(
                alert.is_none(),
                "{name}: the rule before it has no runbook_url"
            );
            alert = Some(name.to_string());
        }
        if let Some(url) = line.strip_prefix("runbook_url: ") {
            let name = alert.take().expect("a runbook_url inside a rule");
            let url = url.trim_matches('\'');
            let anchor = url
                .strip_prefix("docs/runbook.md#")
                .unwrap_or_else(|| panic!("{name}: {url} is not a section of docs/runbook.md"));
            assert!(
                anchors.iter().any(|a| a == anchor),
                "{name}: docs/runbook.md has no section #{anchor}"
            );
            linked += 1;
        }
    }
    assert!(alert.is_none(), "{alert:?} has no runbook_url");
    assert_eq!(linked, 9, "every rule links to the runbook");
}

#[test]
fn prometheus_scrapes_the_metrics_worker() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let metrics_port = port("OUTBOX_METRICS_PORT");
    let _on = MetricsOn::new(&cluster, &format!("127.0.0.1:{metrics_port}"));
    let mut c2 = cluster.connect();
    let _ = &mut c;
    // A worker of its own, not a client connection and not a delivery worker.
    assert!(
        wait_until(Duration::from_secs(20), || count(
            &mut c2,
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_delivery metrics'",
            &[]
        ) == 1),
        "the metrics worker runs"
    );
    let ch = unique("scraped");
    create_channel(&mut c2, &ch, &sim.send_url(&ch), "{}");
    c2.execute(
        "SELECT outbox.pause_channel($1, 'metrics test: queued')",
        &[&ch],
    )
    .unwrap();
    for i in 0..3 {
        enqueue(&mut c2, &ch, &unique(&format!("q{i}")));
    }
    assert!(
        wait_until(Duration::from_secs(20), || get(metrics_port, "/metrics")
            .map(|(s, b)| s == 200
                && b.contains(&format!(
                    "outbox_queued{{database=\"outbox\",channel=\"{ch}\"}} 3"
                )))
            .unwrap_or(false)),
        "GET /metrics shows 3 queued, labelled with the database: {:?}",
        get(metrics_port, "/metrics")
    );
    assert_eq!(get(metrics_port, "/nothing").map(|r| r.0).ok(), Some(404));
    let prometheus = Prometheus::start(
        port("OUTBOX_PROMETHEUS_PORT"),
        &format!("127.0.0.1:{metrics_port}"),
    );
    let queued = format!("outbox_queued{{channel=\"{ch}\",database=\"outbox\"}}");
    assert!(
        wait_until(Duration::from_secs(30), || prometheus
            .query(&queued)
            .first()
            .is_some_and(|r| r["value"][1] == "3")),
        "Prometheus has {queued} = 3: {:?}",
        prometheus.query(&queued)
    );
    // Deliveries while Prometheus scrapes: the counter's rate goes up.
    c2.execute("SELECT outbox.resume_channel($1)", &[&ch])
        .unwrap();
    for round in 0..6 {
        for i in 0..5 {
            enqueue(&mut c2, &ch, &unique(&format!("r{round}_{i}")));
        }
        std::thread::sleep(Duration::from_millis(700));
    }
    let rate = format!("rate(outbox_delivered_total{{channel=\"{ch}\"}}[30s])");
    assert!(
        wait_until(Duration::from_secs(30), || prometheus
            .query(&rate)
            .first()
            .and_then(|r| r["value"][1].as_str().and_then(|v| v.parse::<f64>().ok()))
            .is_some_and(|v| v > 0.0)),
        "Prometheus computes a delivery rate: {:?}",
        prometheus.query(&rate)
    );
    let up = prometheus.query("up{job=\"outbox\"}");
    assert_eq!(
        up.first().map(|r| r["value"][1].clone()),
        Some(serde_json::json!("1")),
        "{up:?}"
    );
}

/// The text of `GET /metrics` once `ready` holds for it (or the last one seen).
fn scrape_until(port: u16, ready: impl Fn(&str) -> bool) -> String {
    let mut last = String::new();
    wait_until(Duration::from_secs(30), || {
        last = get(port, "/metrics").map(|r| r.1).unwrap_or_default();
        ready(&last)
    });
    last
}

#[test]
fn one_scrape_holds_every_database_served() {
    let base =
        std::env::var("OUTBOX_METRICS_BASE").unwrap_or_else(|_| "/tmp/outbox_metrics".into());
    let pg_port: u16 = outbox_e2e::cluster::env_port("OUTBOX_METRICS_PGPORT", 54891);
    let metrics_port = port("OUTBOX_METRICS_PORT");
    let cluster = OwnCluster::fresh(
        PathBuf::from(base),
        pg_port,
        "m_one, m_two, m_bare, m_gone",
        1,
        &format!("outbox.metrics_address = '127.0.0.1:{metrics_port}'"),
    );
    // The same channel name in two databases, with 2 and 3 messages queued.
    for (db, queued) in [("m_one", 2), ("m_two", 3)] {
        let mut c = cluster.connect_to(db);
        create_channel(&mut c, "scraped", "http://127.0.0.1:9/never", "{}");
        c.execute(
            "SELECT outbox.pause_channel('scraped', 'metrics test: queued')",
            &[],
        )
        .unwrap();
        for i in 0..queued {
            enqueue(&mut c, "scraped", &format!("{db}-{i}"));
        }
    }
    // One database loses the extension, one is dropped.
    cluster
        .connect_to("m_bare")
        .batch_execute("DROP EXTENSION outbox_delivery")
        .unwrap();
    cluster
        .connect_to("postgres")
        .batch_execute("DROP DATABASE m_gone WITH (FORCE)")
        .unwrap();

    let text = scrape_until(metrics_port, |t| {
        t.contains("outbox_queued{database=\"m_one\",channel=\"scraped\"} 2")
            && t.contains("outbox_queued{database=\"m_two\",channel=\"scraped\"} 3")
    });
    for expected in [
        "outbox_queued{database=\"m_one\",channel=\"scraped\"} 2",
        "outbox_queued{database=\"m_two\",channel=\"scraped\"} 3",
        "outbox_metrics_database_up{database=\"m_one\"} 1",
        "outbox_metrics_database_up{database=\"m_two\"} 1",
        "# outbox_delivery: database \"m_bare\": extension outbox_delivery is not installed there",
        "outbox_metrics_database_up{database=\"m_bare\"} 0",
        "# outbox_delivery: database \"m_gone\": the database does not exist, or is being dropped",
        "outbox_metrics_database_up{database=\"m_gone\"} 0",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} is not in the scrape:\n{text}"
        );
    }
    // Every family is described once, though two databases report it.
    for family in ["outbox_queued", "outbox_metrics_database_up"] {
        assert_eq!(
            text.matches(&format!("# TYPE {family} ")).count(),
            1,
            "{family} described once:\n{text}"
        );
    }
    let mut c = cluster.connect_to("m_one");
    // The listener is bound to no database; the scrape workers are gone once it answered.
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM pg_stat_activity
              WHERE backend_type = 'outbox_delivery metrics' AND datname IS NULL",
            &[]
        ),
        1
    );
    assert!(wait_until(Duration::from_secs(10), || {
        count(
        &mut c,
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_delivery metrics scrape'",
        &[]
    ) == 0
    }));
    // The extension comes back: its figures come back without a restart.
    cluster
        .connect_to("m_bare")
        .batch_execute("CREATE EXTENSION outbox_delivery")
        .unwrap();
    let text = scrape_until(metrics_port, |t| {
        t.contains("outbox_metrics_database_up{database=\"m_bare\"} 1")
    });
    assert!(
        text.contains("outbox_worker_up{database=\"m_bare\"} "),
        "m_bare's figures are back:\n{text}"
    );
    // Many scrapes in a row leave no scrape worker and no answer file behind.
    for _ in 0..20 {
        assert_eq!(get(metrics_port, "/metrics").map(|r| r.0).ok(), Some(200));
    }
    let leftovers = std::fs::read_dir(cluster.base.join("pgdata/pg_stat_tmp"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with("outbox_metrics.")
                })
                .count()
        })
        .unwrap_or(0);
    assert_eq!(leftovers, 0, "answer files left in pg_stat_tmp");
}
