//! The command lines of the benchmark programs: `--name value` pairs.

/// The text after `name` on the command line.
pub fn text_arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// The number after `name` on the command line, or `default`.
pub fn num_arg(name: &str, default: usize) -> usize {
    text_arg(name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
