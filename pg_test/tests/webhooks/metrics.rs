//! `/metrics` over HTTP: `outbox.metrics_address` served by a background worker of its own,
//! scraped by a real Prometheus (Debian's `prometheus`, started here on a loopback port),
//! whose HTTP API then answers for `outbox_queued` and a counter rate; the alert rules of
//! `docs/prometheus-rules.yml` pass `promtool check rules`. A server serving several
//! databases answers one scrape with every database's figures, and says which are missing.
//! Every PromQL expression of `docs/grafana-dashboard.json` is evaluated by a real Prometheus
//! scraping a served cluster, and answers with data.

use outbox_e2e::cluster::{env_port, unique, wait_until, Cluster, OwnCluster};
use outbox_e2e::helpers::{cluster_and_sim, count, create_channel, enqueue, wait_for_count};
use outbox_e2e::sim::Simulator;
use serde_json::Value;
use std::collections::BTreeSet;
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
    exchange(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    )
}

/// `GET http://127.0.0.1:port{path}` in HTTP/1.0: status and body. Prometheus's API answers
/// an HTTP/1.1 request with a body over 2 kB in chunks, which this reader would not join;
/// an HTTP/1.0 answer is never chunked.
fn get_http10(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    exchange(
        port,
        &format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"),
    )
}

/// Writes `request` to `127.0.0.1:port` and reads the answer to its end: status and body.
fn exchange(port: u16, request: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(request.as_bytes())?;
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

    /// The whole answer of the instant query `q` (`/api/v1/query`): `status` is "success"
    /// or "error" (with `error`), `data.result` the result; null when no JSON came.
    fn answer(&self, q: &str) -> serde_json::Value {
        let encoded: String = q
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        get_http10(self.port, &format!("/api/v1/query?query={encoded}"))
            .ok()
            .and_then(|(_, body)| serde_json::from_str(&body).ok())
            .unwrap_or_default()
    }

    /// The result vector of an instant query.
    fn query(&self, q: &str) -> Vec<serde_json::Value> {
        let v = self.answer(q);
        if v["status"] != "success" {
            return Vec::new();
        }
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
    assert!(text.contains("SUCCESS: 11 rules found"), "{text}");
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
    assert_eq!(linked, 11, "every rule links to the runbook");
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

/// A dashboard's template variables as Prometheus would see them with every value chosen:
/// `$database` and `$channel` (regular-expression matchers) match anything, and the interval
/// variables are one minute (Prometheus scrapes every second here).
fn substitute(expr: &str) -> String {
    let mut text = expr.to_string();
    for (variable, value) in [
        ("${database}", ".*"),
        ("${channel}", ".*"),
        ("$database", ".*"),
        ("$channel", ".*"),
        ("$__rate_interval", "1m"),
        ("$__interval", "1m"),
        ("$__range", "1m"),
    ] {
        text = text.replace(variable, value);
    }
    text
}

/// Every panel target of a Grafana dashboard, rows' nested panels included: (panel title,
/// refId, expr). Each reads the data source the dashboard's `datasource` variable chooses.
fn dashboard_targets(dashboard: &Value) -> Vec<(String, String, String)> {
    fn walk(panels: &Value, out: &mut Vec<(String, String, String)>) {
        for panel in panels.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("?").to_string();
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"]
                    .as_str()
                    .unwrap_or_else(|| panic!("panel {title:?}: a target without expr"));
                let ref_id = target["refId"].as_str().unwrap_or("?").to_string();
                assert_eq!(
                    target["datasource"]["uid"], "${datasource}",
                    "panel {title:?} {ref_id}: the data source is the variable's"
                );
                out.push((title.clone(), ref_id, expr.to_string()));
            }
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// The metric families a scrape describes (its `# TYPE` lines).
fn families(scrape: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for l in scrape.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let mut words = l.split(' ');
        let (Some(name), kind) = (words.next(), words.next()) else {
            continue;
        };
        names.insert(name.to_string());
        // A histogram's series: its buckets, its sum and its count.
        if kind == Some("histogram") {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

/// The extension's metric names an expression reads (`outbox_…`).
fn outbox_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("outbox_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let preceded =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        if !preceded {
            names.insert(expr[start..end].to_string());
        }
        i = end;
    }
    names
}

/// docs/grafana-dashboard.json against a real Prometheus: a served cluster of the test's own
/// (one channel delivering, one paused with a message queued, `outbox.alert_paused_s` = 1 so
/// that the paused channel raises `channel_paused`), scraped every second by Prometheus with
/// the rules of docs/prometheus-rules.yml loaded. Every panel's expression, its template
/// variables substituted, answers `/api/v1/query` with status success and a non-empty
/// result; every `outbox_…` name it reads is a family of the scrape; every template
/// variable's `label_values` selector finds its label.
#[test]
fn every_expression_of_the_grafana_dashboard_answers_with_data() {
    let base =
        std::env::var("OUTBOX_DASHBOARD_BASE").unwrap_or_else(|_| "/tmp/outbox_dashboard".into());
    let pg_port = env_port("OUTBOX_DASHBOARD_PGPORT", 54893);
    let metrics_port = env_port("OUTBOX_DASHBOARD_METRICS_PORT", 54894);
    let prometheus_port = env_port("OUTBOX_DASHBOARD_PROMETHEUS_PORT", 54895);
    let cluster = OwnCluster::fresh(
        PathBuf::from(base),
        pg_port,
        "outbox",
        1,
        &format!("outbox.metrics_address = '127.0.0.1:{metrics_port}'\noutbox.alert_paused_s = 1"),
    );
    let sim = Simulator::start();
    let mut c = cluster.connect();
    create_channel(&mut c, "dash_sent", &sim.send_url("dash_sent"), "{}");
    create_channel(&mut c, "dash_paused", &sim.send_url("dash_paused"), "{}");
    c.execute(
        "SELECT outbox.pause_channel('dash_paused', 'dashboard test: one message left queued')",
        &[],
    )
    .unwrap();
    enqueue(&mut c, "dash_paused", "dash-paused-0");
    for i in 0..5 {
        enqueue(&mut c, "dash_sent", &format!("dash-sent-{i}"));
    }
    assert!(
        wait_for_count(
            &cluster,
            Duration::from_secs(30),
            "SELECT count(*) FROM outbox.messages WHERE channel = 'dash_sent' AND state = 'delivered'",
            &[],
            |n| n == 5
        ),
        "the 5 messages of dash_sent are delivered"
    );

    let prometheus = Prometheus::start(prometheus_port, &format!("127.0.0.1:{metrics_port}"));
    // More deliveries while Prometheus scrapes, so that the rates have something to count.
    for i in 5..10 {
        enqueue(&mut c, "dash_sent", &format!("dash-sent-{i}"));
        std::thread::sleep(Duration::from_millis(500));
    }
    // Scraped a few times (a rate over a minute needs two samples), and the paused channel's
    // alert has reached Prometheus's own ALERTS through the rules.
    let scraped = "count_over_time(outbox_metrics_database_up{database=\"outbox\"}[1m])";
    assert!(
        wait_until(Duration::from_secs(60), || prometheus
            .query(scraped)
            .first()
            .and_then(|r| r["value"][1].as_str().and_then(|v| v.parse::<f64>().ok()))
            .is_some_and(|n| n >= 5.0)),
        "Prometheus scraped /metrics 5 times: {:?}",
        prometheus.answer(scraped)
    );
    let firing =
        "ALERTS{alertname=\"OutboxChannelPaused\",alertstate=\"firing\",channel=\"dash_paused\"}";
    assert!(
        wait_until(Duration::from_secs(30), || !prometheus
            .query(firing)
            .is_empty()),
        "the rule OutboxChannelPaused fires for dash_paused: {:?}",
        prometheus.answer(firing)
    );

    let path = repo().join("docs/grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    assert!(
        dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion: {}",
        dashboard["schemaVersion"]
    );
    let scrape = get(metrics_port, "/metrics")
        .map(|r| r.1)
        .unwrap_or_default();
    let exposed = families(&scrape);
    assert!(exposed.contains("outbox_queued"), "the scrape:\n{scrape}");

    let mut failures = Vec::new();
    // The template variables: `label_values(selector, label)` finds the label.
    let variables = dashboard["templating"]["list"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut names: Vec<&str> = variables
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["channel", "database", "datasource"],
        "template variables"
    );
    for variable in variables.iter().filter(|v| v["type"] == "query") {
        let name = variable["name"].as_str().unwrap_or("?");
        let definition = variable["definition"].as_str().unwrap_or_default();
        let Some((selector, label)) = definition
            .strip_prefix("label_values(")
            .and_then(|d| d.strip_suffix(')'))
            .and_then(|d| d.rsplit_once(','))
        else {
            failures.push(format!(
                "variable {name}: {definition:?} is not label_values(selector, label)"
            ));
            continue;
        };
        let (selector, label) = (substitute(selector.trim()), label.trim().to_string());
        for metric in outbox_names(&selector) {
            if !exposed.contains(&metric) {
                failures.push(format!(
                    "variable {name}: {metric} is not a family of /metrics"
                ));
            }
        }
        let found = prometheus
            .query(&selector)
            .iter()
            .any(|r| r["metric"][&label].is_string());
        if !found {
            failures.push(format!(
                "variable {name}: {selector} has no series with label {label}: {}",
                prometheus.answer(&selector)
            ));
        }
    }

    let targets = dashboard_targets(&dashboard);
    assert!(targets.len() >= 20, "the panels' targets: {targets:?}");
    for (title, ref_id, expr) in &targets {
        let query = substitute(expr);
        assert!(
            !query.contains('$'),
            "panel {title:?} {ref_id}: a variable left in {query}"
        );
        for metric in outbox_names(&query) {
            if !exposed.contains(&metric) {
                failures.push(format!(
                    "panel {title:?} {ref_id}: {metric} is not a family of /metrics"
                ));
            }
        }
        // Prometheus scrapes on meanwhile: a few seconds for a series that is about to appear.
        let mut last = Value::Null;
        let answered = wait_until(Duration::from_secs(10), || {
            last = prometheus.answer(&query);
            last["status"] == "success"
                && last["data"]["result"]
                    .as_array()
                    .is_some_and(|r| !r.is_empty())
        });
        if !answered {
            failures.push(format!(
                "panel {title:?} {ref_id}: {query}\n  answered {last}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "docs/grafana-dashboard.json: {} failures ({} expressions checked):\n{}",
        failures.len(),
        targets.len(),
        failures.join("\n")
    );
    eprintln!(
        "{} expressions of {} panels answered with data",
        targets.len(),
        targets
            .iter()
            .map(|t| t.0.as_str())
            .collect::<BTreeSet<_>>()
            .len()
    );
}
