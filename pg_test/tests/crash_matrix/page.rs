//! docs/reliability.md: a run compares what its rows claim with the page, or rewrites the
//! page with `OUTBOX_WRITE_RELIABILITY=1`.

use super::*;

/// Set to `1` to rewrite docs/reliability.md from this run (`scripts/reliability_doc.sh`);
/// otherwise a run compares its tables with the committed ones and leaves the file alone.
const WRITE_DOC_VAR: &str = "OUTBOX_WRITE_RELIABILITY";

fn doc_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/reliability.md")
}

/// What a table row asserts, as opposed to what it measured on this run.
#[derive(Clone, Copy)]
pub(super) enum Claim {
    /// Scenario, channel kind, "key identical" and verdict, word for word (the crash matrix:
    /// every figure in these columns is fixed by the scenario).
    Exact,
    /// The same columns with every number masked (the soak: how many kills, restarts and
    /// ambiguous jobs a random run gets varies; the verdict's words do not).
    FiguresMasked,
}

/// Splits a Markdown table row into its cells (`\|` inside a cell is not a separator).
fn table_cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(ch) = chars.next() {
        match ch {
            '\\' if chars.peek() == Some(&'|') => {
                cells.last_mut().unwrap().push_str("\\|");
                chars.next();
            }
            '|' => cells.push(String::new()),
            _ => cells.last_mut().unwrap().push(ch),
        }
    }
    cells.into_iter().map(|c| c.trim().to_string()).collect()
}

fn mask_figures(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_number = false;
    for ch in s.chars() {
        if ch.is_ascii_digit() {
            if !in_number {
                out.push('N');
            }
            in_number = true;
        } else {
            out.push(ch);
            in_number = false;
        }
    }
    out
}

/// The claims of every row of the tables in `text`: scenario, channel kind, key identical,
/// verdict (header and separator rows skipped).
fn claims(text: &str, how: Claim) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.starts_with("| scenario |"))
        .map(|l| {
            let cells = table_cells(l);
            let pick = |i: usize| cells.get(i).cloned().unwrap_or_default();
            let claim = format!("{} | {} | {} | {}", pick(0), pick(1), pick(5), pick(6));
            match how {
                Claim::Exact => claim,
                Claim::FiguresMasked => mask_figures(&claim),
            }
        })
        .collect()
}

/// The text between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in `doc`.
fn doc_region<'a>(doc: &'a str, name: &str) -> Option<&'a str> {
    let begin = format!("<!-- {name}:begin -->");
    let end = format!("<!-- {name}:end -->");
    let b = doc.find(&begin)? + begin.len();
    let e = doc[b..].find(&end)? + b;
    Some(&doc[b..e])
}

/// The differences between the rows docs/reliability.md claims and the rows of this run,
/// one `- doc` / `+ run` pair per differing row; empty when they claim the same.
fn claim_diff(documented: &[String], measured: &[String]) -> Vec<String> {
    let mut diff = Vec::new();
    for i in 0..documented.len().max(measured.len()) {
        let (d, m) = (documented.get(i), measured.get(i));
        if d != m {
            diff.push(format!(
                "row {}:\n  - doc: {}\n  + run: {}",
                i + 1,
                d.map_or("(no row)", String::as_str),
                m.map_or("(no row)", String::as_str)
            ));
        }
    }
    diff
}

/// With `OUTBOX_WRITE_RELIABILITY=1`, replaces the text between `<!-- NAME:begin -->` and
/// `<!-- NAME:end -->` in docs/reliability.md (appends the section when the markers are
/// missing). Otherwise compares what the rows of `content` claim with the rows of that region
/// and returns the differences as an error: the page must keep telling what a run shows.
pub(super) fn record_doc_region(name: &str, content: &str, how: Claim) -> Result<(), String> {
    let path = doc_path();
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    if std::env::var(WRITE_DOC_VAR).as_deref() == Ok("1") {
        let begin = format!("<!-- {name}:begin -->");
        let end = format!("<!-- {name}:end -->");
        let block = format!("{begin}\n{content}{end}");
        let new = match (old.find(&begin), old.find(&end)) {
            (Some(b), Some(e)) if b < e => {
                format!("{}{}{}", &old[..b], block, &old[e + end.len()..])
            }
            _ => format!("{old}\n{block}\n"),
        };
        if let Err(e) = std::fs::write(&path, new) {
            eprintln!("note: could not write {}: {e}", path.display());
        }
        return Ok(());
    }
    let Some(documented) = doc_region(&old, name) else {
        return Err(format!(
            "{} has no `{name}` section; write it with scripts/reliability_doc.sh",
            path.display()
        ));
    };
    let diff = claim_diff(&claims(documented, how), &claims(content, how));
    if diff.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the `{name}` table of {} no longer says what this run shows \
         (scenario | channel kind | key identical | verdict):\n{}\n\
         If the change is meant, rewrite the page with scripts/reliability_doc.sh \
         ({WRITE_DOC_VAR}=1) and commit it.",
        path.display(),
        diff.join("\n")
    ))
}

pub(super) fn run_header(cluster: &Cluster) -> String {
    let mut c = cluster.connect();
    let (when, version): (String, String) = c
        .query_one(
            "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI \"UTC\"'), current_setting('server_version')",
            &[],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap_or_else(|_| ("?".into(), "?".into()));
    format!("{when}, PostgreSQL {version}, 2 delivery workers")
}

/// The page comparison needs no cluster: check it on its own.
#[test]
fn the_reliability_page_is_held_to_its_verdicts_not_to_the_figures_of_a_random_run() {
    let header = "| scenario | channel kind | provider: stored / sends | local state | attempts (rows: send, recovery, lookup) | key identical on every attempt | verdict |\n|---|---|---|---|---|---|---|\n";
    let page = format!(
        "{header}| soak: 1000 messages, 6 × kill -9 | neither | 333 stored | a \\| b | 359 send | yes | PASS: 0 lost; 12 ambiguous jobs wait |\n"
    );
    let other_run = format!(
        "{header}| soak: 1000 messages, 7 × kill -9 | neither | 330 stored | c | 350 send | yes | PASS: 0 lost; 9 ambiguous jobs wait |\n"
    );
    let failed_run = format!(
        "{header}| soak: 1000 messages, 7 × kill -9 | neither | 330 stored | c | 350 send | yes | FAIL: 1 effect keys stored more than once |\n"
    );
    assert_eq!(
        table_cells("| a \\| b | c |"),
        vec!["a \\| b".to_string(), "c".to_string()]
    );
    let masked = |t: &str| claims(t, Claim::FiguresMasked);
    assert_eq!(masked(&page).len(), 1, "the header rows are no claims");
    assert!(claim_diff(&masked(&page), &masked(&other_run)).is_empty());
    let diff = claim_diff(&masked(&page), &masked(&failed_run));
    assert_eq!(diff.len(), 1, "{diff:?}");
    assert!(diff[0].contains("- doc:") && diff[0].contains("+ run:") && diff[0].contains("FAIL"));
    let exact = |t: &str| claims(t, Claim::Exact);
    assert_eq!(
        claim_diff(&exact(&page), &exact(&other_run)).len(),
        1,
        "a figure in a crash-matrix claim is part of the claim"
    );
    assert_eq!(
        claim_diff(&exact(&page), &exact(header)),
        vec!["row 1:\n  - doc: soak: 1000 messages, 6 × kill -9 | neither | yes | PASS: 0 lost; 12 ambiguous jobs wait\n  + run: (no row)".to_string()]
    );
    let doc = "intro\n<!-- soak:begin -->\nbody\n<!-- soak:end -->\n";
    assert_eq!(doc_region(doc, "soak"), Some("\nbody\n"));
    assert_eq!(doc_region(doc, "crash-matrix"), None);
}
