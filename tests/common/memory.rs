//! A child process's memory and CPU, read from Linux's `/proc`.

/// A `kB` line of `/proc/PID/status` (`VmRSS`, `VmHWM`), bytes.
fn status_bytes(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap()
        * 1024
}

/// The resident memory of process `pid` now, bytes.
pub fn rss(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS")
}

/// The peak resident memory of process `pid` (`VmHWM`), bytes.
pub fn peak_rss(pid: u32) -> u64 {
    status_bytes(pid, "VmHWM")
}

/// Sets process `pid`'s peak resident memory to its resident memory now (`clear_refs`, value 5).
pub fn reset_peak_rss(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

/// The CPU time process `pid` has used, user and system, seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command's name (in parentheses): utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().collect();
    let ticks = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}
