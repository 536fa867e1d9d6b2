//! The outbound-request guard: which destinations a channel may reach, from the setting
//! `outbox.allowed_hosts`. Pure Rust: used by `create_channel` / `alter_channel` (the
//! endpoint and the reconcile URL), by the worker before each request and by its DNS
//! resolver on every resolved address.
//!
//! The list is comma-separated, whitespace trimmed, case-insensitive. An entry is
//! - `*`: any host;
//! - a host name, `api.example.com`: that host only;
//! - `*.example.com`: every subdomain of example.com, not example.com itself;
//! - an IP address, `127.0.0.1`, `::1` or `[::1]`;
//! - a CIDR, `10.0.0.0/8`, `fd00::/8`.
//!
//! Host names and IP addresses are normalized as the `url` crate normalizes a URL's host
//! (lower case, IDNA, IPv4 in any WHATWG form: `0x7f.1` and `2130706433` are 127.0.0.1), so
//! an entry means the same as the host of a URL that names it. An empty list allows nothing.
//!
//! Some addresses are refused even when the host is allowed (by `*` or by name): link-local
//! and cloud metadata addresses, and the unspecified addresses (see [`SENSITIVE`]). Only an
//! IP or CIDR entry allows one of them, and a CIDR only when it is no wider than the refused
//! range the address lies in: `169.254.169.254` or `169.254.0.0/16` allow the metadata
//! address, `0.0.0.0/0` does not.
//!
//! An IPv6 address that embeds an IPv4 address is that IPv4 address, everywhere: when it is
//! checked and when an entry names it (see [`canonical`]). Those are the IPv4-mapped
//! `::ffff:a.b.c.d`, the NAT64 well-known prefix `64:ff9b::a.b.c.d` and the IPv4-compatible
//! `::a.b.c.d` (but `::` and `::1` are the IPv6 unspecified and loopback addresses). So
//! `[64:ff9b::a9fe:a9fe]` is refused as 169.254.169.254 is, the entry `169.254.169.254`
//! allows it and its other forms, and the entry `64:ff9b::a9fe:a9fe` is 169.254.169.254.
//! An IPv6 block wider than /96 (`::/0`, `64:ff9b::/64`) holds none of them. The
//! IPv4-translated form `::ffff:0:a.b.c.d` (SIIT, RFC 6145) is one of them too.
//!
//! An IPv6 address of a tunnel reaches an IPv4 host without being it: 6to4
//! `2002:AABB:CCDD::/48` (RFC 3056) is sent through a relay to the IPv4 address AABB:CCDD,
//! Teredo `2001:0:SSSS:SSSS:f:p:CCCC:CCCC` (RFC 4380) to its server SSSS:SSSS and to its
//! client, the inverted CCCC:CCCC (see [`tunnelled_ipv4`]). Such an address is refused when
//! an address it reaches is, unless an entry lists it: the IPv4 address it reaches (or a
//! block no wider than the refused range), or the IPv6 address itself (or a block that fixes
//! as many bits of the IPv4 address as the refused range does).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use url::Host;

/// How to write the list, for hints.
pub const LIST_FORMS: &str = "Separate entries by commas; an entry is *, a host name, *.domain, an IP address or a CIDR such as 10.0.0.0/8, without scheme or port.";

/// A range of addresses refused unless an IP or CIDR entry lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SensitiveRange {
    pub network: Network,
    /// What it is, for messages.
    pub what: &'static str,
}

/// Addresses refused unless listed by IP or CIDR. IPv6 addresses that embed an IPv4 address
/// (`::ffff:169.254.169.254`, `64:ff9b::169.254.169.254`, `::169.254.169.254`) are checked
/// as the IPv4 address they embed (see [`canonical`]).
pub const SENSITIVE: &[SensitiveRange] = &[
    SensitiveRange {
        network: Network::v4(Ipv4Addr::new(169, 254, 0, 0), 16),
        what: "IPv4 link-local, which holds the cloud metadata address 169.254.169.254",
    },
    SensitiveRange {
        network: Network::v4(Ipv4Addr::new(100, 100, 100, 200), 32),
        what: "the Alibaba Cloud metadata address",
    },
    SensitiveRange {
        network: Network::v4(Ipv4Addr::new(168, 63, 129, 16), 32),
        what: "the Azure platform address (WireServer), which serves the VM's goal state and certificates",
    },
    SensitiveRange {
        network: Network::v4(Ipv4Addr::new(0, 0, 0, 0), 8),
        what: "IPv4 \"this network\" (0.0.0.0/8), which reaches the local host",
    },
    SensitiveRange {
        network: Network::v6(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10),
        what: "IPv6 link-local",
    },
    SensitiveRange {
        network: Network::v6(Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254), 128),
        what: "the AWS instance metadata IPv6 address",
    },
    SensitiveRange {
        network: Network::v6(Ipv6Addr::UNSPECIFIED, 128),
        what: "the IPv6 unspecified address, which reaches the local host",
    },
];

/// An address block: `addr/prefix`, with no host bits set in `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl Network {
    const fn v4(addr: Ipv4Addr, prefix: u8) -> Network {
        Network {
            addr: IpAddr::V4(addr),
            prefix,
        }
    }

    const fn v6(addr: Ipv6Addr, prefix: u8) -> Network {
        Network {
            addr: IpAddr::V6(addr),
            prefix,
        }
    }

    /// `addr/prefix`; `Err` when the prefix is too long for the family or host bits are set.
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Network, String> {
        let max = bits(addr);
        if prefix > max {
            return Err(format!("prefix length {prefix} is longer than {max}"));
        }
        let masked = mask(addr, prefix);
        if masked != addr {
            return Err(format!(
                "has host bits set; the network is {masked}/{prefix}"
            ));
        }
        // A block inside ::ffff:0:0/96, 64:ff9b::/96 or ::/96 is the IPv4 block its addresses
        // embed: `::ffff:169.254.0.0/112` and `64:ff9b::a9fe:0/112` are 169.254.0.0/16. A
        // block based at `::` (`::/96` to `::/128`) holds `::` (and `::1`), which embed
        // nothing: it stays an IPv6 block and so lists only those two, the IPv4-compatible
        // addresses in it being IPv4 addresses (list them as 0.0.0.0/N).
        if let (IpAddr::V6(v6), true) = (addr, prefix >= 96) {
            if let Some(v4) = embedded_ipv4(v6) {
                return Ok(Network::v4(v4, prefix - 96));
            }
        }
        Ok(Network { addr, prefix })
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Is `ip` (already canonical) inside this block?
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => {
                mask(ip, self.prefix) == self.addr
            }
            _ => false,
        }
    }
}

impl fmt::Display for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

fn bits(ip: IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(a) => {
            let m = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix.min(32)))
            };
            IpAddr::V4(Ipv4Addr::from(u32::from(a) & m))
        }
        IpAddr::V6(a) => {
            let m = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(prefix.min(128)))
            };
            IpAddr::V6(Ipv6Addr::from(u128::from(a) & m))
        }
    }
}

/// The high 96 bits of the NAT64 well-known prefix `64:ff9b::/96` (RFC 6052).
const NAT64_WELL_KNOWN: u128 = 0x0064_ff9b_0000_0000_0000_0000;
/// The high 96 bits of the IPv4-translated prefix `::ffff:0:0:0/96` (RFC 6145, SIIT).
const IPV4_TRANSLATED: u128 = 0xffff_0000;

/// The IPv4 address an IPv6 address stands for, if it embeds one in its low 32 bits:
/// - IPv4-mapped, `::ffff:a.b.c.d` (`::ffff:0:0/96`): the IPv4 address itself, as the
///   socket layer of a dual-stack host sends it;
/// - NAT64 well-known prefix, `64:ff9b::a.b.c.d` (`64:ff9b::/96`, RFC 6052): a NAT64
///   translator on the path sends it to a.b.c.d;
/// - IPv4-translated, `::ffff:0:a.b.c.d` (`::ffff:0:0:0/96`, RFC 6145): a stateless
///   translator on the path sends it to a.b.c.d;
/// - IPv4-compatible, `::a.b.c.d` (`::/96`, deprecated by RFC 4291): a.b.c.d, except `::`
///   (unspecified) and `::1` (loopback), which keep their IPv6 meaning.
///
/// Not the local-use NAT64 prefix `64:ff9b:1::/48` (RFC 8215), nor any other
/// network-specific prefix: there the operator chooses the prefix length (32 to 96, RFC 6052
/// section 2.2), which places the IPv4 address at different bits, skipping bits 64 to 71. The
/// low 32 bits are that address only under a /96; under a /48 or /56 they are always zero, so
/// reading them would refuse every address of such a translator as 0.0.0.0, and let an entry
/// `10.0.0.0/8` allow addresses that reach elsewhere. Which prefix a network translates, and
/// how, is known only to its operator, who must keep it from reaching sensitive addresses.
fn embedded_ipv4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let bits = u128::from(v6);
    let low = Ipv4Addr::from(bits as u32);
    match bits >> 32 {
        NAT64_WELL_KNOWN | IPV4_TRANSLATED => Some(low),
        0 if bits > 1 => Some(low),
        _ => None,
    }
}

/// The prefix of 6to4 addresses, `2002::/16` (RFC 3056), as the high 16 bits.
const SIX_TO_FOUR: u128 = 0x2002;
/// The prefix of Teredo addresses, `2001:0::/32` (RFC 4380), as the high 32 bits.
const TEREDO: u128 = 0x2001_0000;

/// An IPv4 address that an IPv6 address of a tunnel reaches, and how many leading bits of
/// the IPv6 address come before it (so that a block of IPv6 addresses fixes `offset + n`
/// bits to fix `n` bits of the IPv4 address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tunnelled {
    pub ipv4: Ipv4Addr,
    pub offset: u8,
}

/// The IPv4 addresses an IPv6 address reaches through a tunnel, which the address does not
/// stand for as a whole (many IPv6 addresses reach each of them):
/// - 6to4, `2002:AABB:CCDD::/48`: the relay sends to AABB:CCDD (bits 16 to 47);
/// - Teredo, `2001:0:SSSS:SSSS:flags:port:CCCC:CCCC`: the server SSSS:SSSS (bits 32 to
///   63), and the client, CCCC:CCCC with every bit inverted (bits 96 to 127).
pub fn tunnelled_ipv4(v6: Ipv6Addr) -> Vec<Tunnelled> {
    let bits = u128::from(v6);
    if bits >> 112 == SIX_TO_FOUR {
        return vec![Tunnelled {
            ipv4: Ipv4Addr::from((bits >> 80) as u32),
            offset: 16,
        }];
    }
    if bits >> 96 == TEREDO {
        return vec![
            Tunnelled {
                ipv4: Ipv4Addr::from((bits >> 64) as u32),
                offset: 32,
            },
            Tunnelled {
                ipv4: Ipv4Addr::from(!(bits as u32)),
                offset: 96,
            },
        ];
    }
    Vec::new()
}

/// An IPv6 address that embeds an IPv4 address (IPv4-mapped, NAT64 well-known prefix,
/// IPv4-compatible: see [`embedded_ipv4`]) as that IPv4 address; anything else unchanged.
/// Every check and every IP entry goes through it, so each form means the same.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => embedded_ipv4(v6).map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The refused range `ip` lies in, if any: the range of the address itself (canonical), or
/// of an IPv4 address it reaches through a tunnel ([`tunnelled_ipv4`]).
pub fn sensitive_range(ip: IpAddr) -> Option<&'static SensitiveRange> {
    sensitive_reach(ip).first().map(|s| s.range)
}

/// An address refused unless listed, that a connection to some address would reach.
#[derive(Debug, Clone, Copy)]
struct SensitiveReach {
    /// The address reached: the canonical address itself, or the IPv4 address of a tunnel.
    reached: IpAddr,
    /// Leading bits of the address connected to before those of `reached` (0 for the
    /// address itself).
    offset: u8,
    range: &'static SensitiveRange,
}

/// Every refused address a connection to `ip` reaches: the address itself, and the IPv4
/// addresses a tunnel sends it to.
fn sensitive_reach(ip: IpAddr) -> Vec<SensitiveReach> {
    let ip = canonical(ip);
    let tunnelled = match ip {
        IpAddr::V6(v6) => tunnelled_ipv4(v6),
        IpAddr::V4(_) => Vec::new(),
    };
    std::iter::once((ip, 0))
        .chain(
            tunnelled
                .into_iter()
                .map(|t| (IpAddr::V4(t.ipv4), t.offset)),
        )
        .filter_map(|(reached, offset)| {
            SENSITIVE
                .iter()
                .find(|r| r.network.contains(reached))
                .map(|range| SensitiveReach {
                    reached,
                    offset,
                    range,
                })
        })
        .collect()
}

/// One entry of the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// `*`
    Any,
    /// `api.example.com` (normalized: lower case, IDNA, no trailing dot)
    Host(String),
    /// `*.example.com`, stored as `example.com`
    Subdomains(String),
    /// `127.0.0.1`, `::1` (canonical: an IPv6 address that embeds an IPv4 address, such
    /// as `::ffff:a.b.c.d` or `64:ff9b::a.b.c.d`, is stored as that IPv4 address)
    Address(IpAddr),
    /// `10.0.0.0/8`
    Network(Network),
}

/// A rejected entry of `outbox.allowed_hosts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidEntry {
    pub entry: String,
    pub message: String,
}

impl fmt::Display for InvalidEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "entry \"{}\" {}", self.entry, self.message)
    }
}

impl std::error::Error for InvalidEntry {}

/// A parsed `outbox.allowed_hosts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowList {
    source: String,
    entries: Vec<Entry>,
}

impl AllowList {
    /// Parses the setting's text; an empty text allows nothing.
    pub fn parse(text: &str) -> Result<AllowList, InvalidEntry> {
        let entries = text
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                parse_entry(e).map_err(|message| InvalidEntry {
                    entry: e.to_string(),
                    message,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AllowList {
            source: text.trim().to_string(),
            entries,
        })
    }

    /// The list that allows nothing (what an invalid setting amounts to).
    pub fn nothing() -> AllowList {
        AllowList {
            source: String::new(),
            entries: Vec::new(),
        }
    }

    /// The setting's text, trimmed, for messages.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    fn name_allowed(&self, name: &str) -> bool {
        let name = name.strip_suffix('.').unwrap_or(name);
        self.entries.iter().any(|e| match e {
            Entry::Any => true,
            Entry::Host(h) => h == name,
            Entry::Subdomains(d) => {
                name.len() > d.len() + 1
                    && name.ends_with(d.as_str())
                    && name.as_bytes()[name.len() - d.len() - 1] == b'.'
            }
            Entry::Address(_) | Entry::Network(_) => false,
        })
    }

    /// Is `ip` (canonical) named by `*` or by an IP or CIDR entry?
    fn ip_listed(&self, ip: IpAddr) -> bool {
        self.entries.iter().any(|e| match e {
            Entry::Any => true,
            Entry::Address(a) => *a == ip,
            Entry::Network(n) => n.contains(ip),
            Entry::Host(_) | Entry::Subdomains(_) => false,
        })
    }
}

fn parse_entry(raw: &str) -> Result<Entry, String> {
    let e = raw.to_lowercase();
    if e == "*" {
        return Ok(Entry::Any);
    }
    if let Some(domain) = e.strip_prefix("*.") {
        if domain.contains('*') {
            return Err("may contain one wildcard only, at its start, as in *.example.com".into());
        }
        return match host_of(domain) {
            Some(Host::Domain(d)) => Ok(Entry::Subdomains(valid_name(&d)?)),
            Some(_) => Err("is a wildcard over an IP address; write the address or a CIDR".into()),
            None => Err("is not a wildcard over a host name, as in *.example.com".into()),
        };
    }
    if e.contains('*') {
        return Err(
            "has a wildcard that is not \"*\" alone or at its start, as in *.example.com".into(),
        );
    }
    if let Some((addr, prefix)) = e.split_once('/') {
        let addr = ip_literal(addr)
            .ok_or_else(|| "is not a CIDR: the part before / is not an IP address".to_string())?;
        let prefix: u8 = prefix
            .parse()
            .map_err(|_| "is not a CIDR: the part after / is not a prefix length".to_string())?;
        return Network::new(addr, prefix)
            .map(Entry::Network)
            .map_err(|m| format!("is not a CIDR: {m}"));
    }
    if let Some(ip) = ip_literal(&e) {
        return Ok(Entry::Address(canonical(ip)));
    }
    if e.contains("://") || e.contains(':') || e.contains('/') {
        return Err(
            "is not a host name: write the host alone, without scheme, port or path".into(),
        );
    }
    match host_of(&e) {
        Some(Host::Domain(d)) => Ok(Entry::Host(valid_name(&d)?)),
        Some(Host::Ipv4(a)) => Ok(Entry::Address(IpAddr::V4(a))),
        Some(Host::Ipv6(a)) => Ok(Entry::Address(canonical(IpAddr::V6(a)))),
        None => Err("is not a host name, IP address or CIDR".into()),
    }
}

/// `::1`, `[::1]`, `127.0.0.1` (strict: dotted decimal or standard IPv6 text).
fn ip_literal(s: &str) -> Option<IpAddr> {
    let s = s
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or(s);
    s.parse().ok()
}

/// A host as the `url` crate normalizes a URL's host; `[..]` and bare IPv6 both accepted.
fn host_of(s: &str) -> Option<Host<String>> {
    if let Some(IpAddr::V6(a)) = ip_literal(s) {
        return Some(Host::Ipv6(a));
    }
    Host::parse(s).ok()
}

/// A normalized host name without its trailing dot, made of labels of letters, digits,
/// hyphens and underscores.
fn valid_name(d: &str) -> Result<String, String> {
    let d = d.strip_suffix('.').unwrap_or(d);
    let ok = !d.is_empty()
        && d.len() <= 253
        && d.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if ok {
        Ok(d.to_string())
    } else {
        Err("is not a valid host name".into())
    }
}

/// Does the list allow `host`, a URL's host: a name or an IP literal (`[::1]` or `::1`)?
/// Only the host is checked here; an IP literal must also pass [`address_allowed`].
pub fn host_allowed(list: &AllowList, host: &str) -> bool {
    match host_of(host.trim()) {
        Some(Host::Domain(d)) => list.name_allowed(&d),
        Some(Host::Ipv4(a)) => list.ip_listed(IpAddr::V4(a)),
        Some(Host::Ipv6(a)) => list.ip_listed(canonical(IpAddr::V6(a))),
        None => false,
    }
}

/// May a connection go to `ip` (resolved, or the URL's literal) once its host was allowed?
/// Yes unless it lies in a [`SENSITIVE`] range that no IP or CIDR entry of the list unlocks.
/// An address of a tunnel must be unlocked for every refused address it reaches: by an entry
/// that lists the address reached, or one that lists the address itself and fixes at least
/// as many bits of the address reached as the refused range does.
pub fn address_allowed(list: &AllowList, ip: IpAddr) -> bool {
    first_refused(list, ip).is_none()
}

/// The first refused address that a connection to `ip` reaches and that no IP or CIDR entry
/// of the list unlocks.
fn first_refused(list: &AllowList, ip: IpAddr) -> Option<SensitiveReach> {
    let ip = canonical(ip);
    sensitive_reach(ip).into_iter().find(|s| {
        let unlocked = |candidate: IpAddr, prefix: u8| {
            list.entries.iter().any(|e| match e {
                Entry::Address(a) => *a == candidate,
                Entry::Network(n) => n.contains(candidate) && n.prefix >= prefix,
                Entry::Any | Entry::Host(_) | Entry::Subdomains(_) => false,
            })
        };
        let prefix = s.range.network.prefix;
        let by_reached = unlocked(s.reached, prefix);
        let by_itself = s.offset > 0 && unlocked(ip, s.offset.saturating_add(prefix));
        !(by_reached || by_itself)
    })
}

/// Why a destination was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// The host matches no entry.
    NotListed,
    /// The host is an IP literal in a sensitive range no IP or CIDR entry lists.
    Sensitive { address: IpAddr, what: &'static str },
    /// Every address the name resolved to is in a sensitive range no entry lists.
    OnlySensitiveAddresses { addresses: Vec<IpAddr> },
}

/// A destination refused by `outbox.allowed_hosts`; nothing was sent to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// As a URL writes it: `api.example.com`, `169.254.169.254`, `[fe80::1]`.
    pub host: String,
    pub reason: Reason,
}

impl Refusal {
    /// One sentence on why, for the detail of an error.
    pub fn explanation(&self) -> String {
        match &self.reason {
            Reason::NotListed => "The host matches no entry of outbox.allowed_hosts.".into(),
            Reason::Sensitive { address, what } => format!(
                "{address} is {what}; such addresses are refused unless an IP or CIDR entry of outbox.allowed_hosts lists them (\"*\" and host names do not)."
            ),
            Reason::OnlySensitiveAddresses { addresses } => format!(
                "The host resolves only to {}, in ranges refused unless an IP or CIDR entry of outbox.allowed_hosts lists them.",
                join(addresses)
            ),
        }
    }
}

fn join(addresses: &[IpAddr]) -> String {
    addresses
        .iter()
        .map(IpAddr::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "destination refused by outbox.allowed_hosts: host {}",
            self.host
        )?;
        match &self.reason {
            Reason::NotListed => f.write_str(" is not listed"),
            Reason::Sensitive { what, .. } => write!(f, " is {what}"),
            Reason::OnlySensitiveAddresses { addresses } => write!(
                f,
                " resolves only to refused addresses ({})",
                join(addresses)
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// Checks a URL's host: the host must be allowed and, when it is an IP literal, so must
/// the address. Names are checked again on each resolved address by [`filter_resolved`].
pub fn check_host(list: &AllowList, host: &Host<&str>) -> Result<(), Refusal> {
    let (text, ip) = match host {
        Host::Domain(d) => (d.to_string(), None),
        Host::Ipv4(a) => (a.to_string(), Some(IpAddr::V4(*a))),
        Host::Ipv6(a) => (format!("[{a}]"), Some(IpAddr::V6(*a))),
    };
    let listed = match ip {
        None => list.name_allowed(&text),
        Some(ip) => list.ip_listed(canonical(ip)),
    };
    if !listed {
        return Err(Refusal {
            host: text,
            reason: Reason::NotListed,
        });
    }
    match ip.and_then(|ip| first_refused(list, ip)) {
        Some(refused) => Err(Refusal {
            host: text,
            reason: Reason::Sensitive {
                address: refused.reached,
                what: refused.range.what,
            },
        }),
        None => Ok(()),
    }
}

/// Checks the host of a parsed URL (see [`check_host`]); a URL without a host is refused.
pub fn check_url(list: &AllowList, url: &url::Url) -> Result<(), Refusal> {
    match url.host() {
        Some(host) => check_host(list, &host),
        None => Err(Refusal {
            host: "(none)".into(),
            reason: Reason::NotListed,
        }),
    }
}

/// What a resolver may connect to for `host`: its allowed addresses, in order. `Err` when
/// the host is not allowed, or when it resolved to addresses and none of them is allowed.
pub fn filter_resolved(
    list: &AllowList,
    host: &str,
    resolved: impl IntoIterator<Item = SocketAddr>,
) -> Result<Vec<SocketAddr>, Refusal> {
    let host = host.strip_suffix('.').unwrap_or(host);
    if !host_allowed(list, host) {
        return Err(Refusal {
            host: host.to_string(),
            reason: Reason::NotListed,
        });
    }
    let (kept, refused): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved
        .into_iter()
        .partition(|a| address_allowed(list, a.ip()));
    if kept.is_empty() && !refused.is_empty() {
        let mut addresses: Vec<IpAddr> = refused.iter().map(|a| canonical(a.ip())).collect();
        addresses.dedup();
        return Err(Refusal {
            host: host.to_string(),
            reason: Reason::OnlySensitiveAddresses { addresses },
        });
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(s: &str) -> AllowList {
        AllowList::parse(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// The host of a URL as reqwest sends it (the `url` crate normalizes it).
    fn url_host(u: &str) -> String {
        url::Url::parse(u).unwrap().host_str().unwrap().to_string()
    }

    #[test]
    fn entries_parse_to_their_forms() {
        let cases: &[(&str, Entry)] = &[
            ("*", Entry::Any),
            ("api.example.com", Entry::Host("api.example.com".into())),
            ("API.Example.COM", Entry::Host("api.example.com".into())),
            ("api.example.com.", Entry::Host("api.example.com".into())),
            ("localhost", Entry::Host("localhost".into())),
            ("my_host.internal", Entry::Host("my_host.internal".into())),
            (
                "bücher.example",
                Entry::Host("xn--bcher-kva.example".into()),
            ),
            ("*.example.com", Entry::Subdomains("example.com".into())),
            ("*.EXAMPLE.com.", Entry::Subdomains("example.com".into())),
            ("127.0.0.1", Entry::Address(ip("127.0.0.1"))),
            ("::1", Entry::Address(ip("::1"))),
            ("[::1]", Entry::Address(ip("::1"))),
            ("[FD00:EC2::254]", Entry::Address(ip("fd00:ec2::254"))),
            (
                "::ffff:169.254.169.254",
                Entry::Address(ip("169.254.169.254")),
            ),
            ("64:ff9b::a9fe:a9fe", Entry::Address(ip("169.254.169.254"))),
            (
                "[64:ff9b::169.254.169.254]",
                Entry::Address(ip("169.254.169.254")),
            ),
            ("::169.254.169.254", Entry::Address(ip("169.254.169.254"))),
            ("::", Entry::Address(ip("::"))),
            ("[::0.0.0.1]", Entry::Address(ip("::1"))),
            ("::2", Entry::Address(ip("0.0.0.2"))),
            // The local-use NAT64 prefix embeds nothing the guard can read.
            (
                "64:ff9b:1::a9fe:a9fe",
                Entry::Address(ip("64:ff9b:1::a9fe:a9fe")),
            ),
            // WHATWG IPv4 forms mean what they mean in a URL.
            ("0x7f.1", Entry::Address(ip("127.0.0.1"))),
            ("2130706433", Entry::Address(ip("127.0.0.1"))),
            ("0177.0.0.1", Entry::Address(ip("127.0.0.1"))),
            (
                "10.0.0.0/8",
                Entry::Network(Network::v4(Ipv4Addr::new(10, 0, 0, 0), 8)),
            ),
            (
                "0.0.0.0/0",
                Entry::Network(Network::v4(Ipv4Addr::UNSPECIFIED, 0)),
            ),
            (
                "fd00::/8",
                Entry::Network(Network::v6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0), 8)),
            ),
            (
                "[fd00::]/8",
                Entry::Network(Network::v6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0), 8)),
            ),
            (
                "::ffff:169.254.0.0/112",
                Entry::Network(Network::v4(Ipv4Addr::new(169, 254, 0, 0), 16)),
            ),
            (
                "64:ff9b::a9fe:0/112",
                Entry::Network(Network::v4(Ipv4Addr::new(169, 254, 0, 0), 16)),
            ),
            (
                "64:ff9b::/96",
                Entry::Network(Network::v4(Ipv4Addr::UNSPECIFIED, 0)),
            ),
            (
                "::a9fe:0/112",
                Entry::Network(Network::v4(Ipv4Addr::new(169, 254, 0, 0), 16)),
            ),
            // Based at ::, it holds :: and ::1: an IPv6 block.
            (
                "::/96",
                Entry::Network(Network::v6(Ipv6Addr::UNSPECIFIED, 96)),
            ),
            (
                "64:ff9b::/64",
                Entry::Network(Network::v6(
                    Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0),
                    64,
                )),
            ),
            (
                "169.254.169.254/32",
                Entry::Network(Network::v4(Ipv4Addr::new(169, 254, 169, 254), 32)),
            ),
        ];
        for (text, entry) in cases {
            assert_eq!(list(text).entries(), std::slice::from_ref(entry), "{text}");
        }
    }

    #[test]
    fn lists_are_split_trimmed_and_may_be_empty() {
        let l = list("  api.example.com , *.hooks.example.org,10.0.0.0/8 ,, ");
        assert_eq!(l.entries().len(), 3);
        assert_eq!(
            l.source(),
            "api.example.com , *.hooks.example.org,10.0.0.0/8 ,,"
        );
        assert!(list("").entries().is_empty());
        assert!(list("  ").entries().is_empty());
        assert!(list(" , ").entries().is_empty());
        assert_eq!(AllowList::nothing().entries(), &[] as &[Entry]);
    }

    #[test]
    fn invalid_entries_are_named() {
        let cases: &[&str] = &[
            "https://api.example.com",
            "api.example.com:443",
            "api.example.com/path",
            "api.*.com",
            "*example.com",
            "*.*.example.com",
            "**",
            "*.",
            "*.10.0.0.1",
            "exa mple.com",
            "a!b.com",
            "a..b",
            "user@host",
            "10.0.0.0/33",
            "fd00::/129",
            "10.0.0.1/8",
            "10.0.0.0/x",
            "10.0.0.0/",
            "host/8",
            "[::1",
            "fe80::1%eth0",
            "300.1.1.1",
        ];
        for bad in cases {
            let e =
                AllowList::parse(&format!("api.example.com, {bad} ,10.0.0.0/8")).expect_err(bad);
            assert_eq!(e.entry, bad.trim(), "{bad}");
            assert!(
                e.to_string().contains(&format!("\"{}\"", bad.trim())),
                "{e}"
            );
        }
        let e = AllowList::parse("10.0.0.1/8").unwrap_err();
        assert!(e.message.contains("10.0.0.0/8"), "{e}");
    }

    #[test]
    fn hosts_against_lists() {
        // (list, host, allowed)
        let cases: &[(&str, &str, bool)] = &[
            ("*", "api.example.com", true),
            ("*", "127.0.0.1", true),
            ("*", "[::1]", true),
            ("*", "169.254.169.254", true), // the address check refuses it
            ("", "api.example.com", false),
            ("", "127.0.0.1", false),
            ("api.example.com", "api.example.com", true),
            ("api.example.com", "API.EXAMPLE.COM", true),
            ("api.example.com", "api.example.com.", true),
            ("API.example.com", "api.example.com", true),
            ("api.example.com", "example.com", false),
            ("api.example.com", "x.api.example.com", false),
            ("api.example.com", "api.example.com.evil.com", false),
            ("api.example.com", "apiexample.com", false),
            ("example.com", "evil-example.com", false),
            ("*.example.com", "api.example.com", true),
            ("*.example.com", "a.b.example.com", true),
            ("*.example.com", "evil.com.example.com", true),
            ("*.example.com", "API.Example.Com.", true),
            ("*.example.com", "example.com", false),
            ("*.example.com", "example.com.", false),
            ("*.example.com", "xexample.com", false),
            ("*.example.com", "example.com.evil.com", false),
            ("*.example.com", "evilexample.com", false),
            ("*.example.com", ".example.com", false),
            ("*.example.com", "127.0.0.1", false),
            ("example.com, *.example.com", "example.com", true),
            ("127.0.0.1", "127.0.0.1", true),
            ("127.0.0.1", "127.0.0.2", false),
            ("127.0.0.1", "localhost", false),
            ("localhost", "127.0.0.1", false),
            ("localhost", "localhost", true),
            ("::1", "[::1]", true),
            ("::1", "::1", true),
            ("[::1]", "[0:0:0:0:0:0:0:1]", true),
            ("::1", "127.0.0.1", false),
            ("127.0.0.1", "[::ffff:127.0.0.1]", true),
            ("10.0.0.0/8", "10.1.2.3", true),
            ("10.0.0.0/8", "11.0.0.1", false),
            ("10.0.0.0/8", "[::ffff:10.0.0.1]", true),
            // NAT64 (64:ff9b::/96) and IPv4-compatible forms are the IPv4 address they embed.
            ("127.0.0.1", "[64:ff9b::7f00:1]", true),
            ("127.0.0.1", "[64:ff9b::127.0.0.1]", true),
            ("127.0.0.1", "[::127.0.0.1]", true),
            ("10.0.0.0/8", "[64:ff9b::a00:1]", true),
            ("10.0.0.0/8", "[::10.0.0.1]", true),
            ("10.0.0.0/8", "[64:ff9b::b00:1]", false),
            ("64:ff9b::a00:0/104", "10.0.0.1", true),
            ("64:ff9b::a00:0/104", "[::ffff:10.0.0.1]", true),
            ("::10.0.0.1", "[64:ff9b::10.0.0.1]", true),
            ("0.0.0.0/0", "[64:ff9b::808:808]", true),
            ("::/0", "[64:ff9b::808:808]", false),
            ("::/0", "[::8.8.8.8]", false),
            ("64:ff9b::/64", "[64:ff9b::808:808]", false),
            ("64:ff9b::/96", "[64:ff9b::808:808]", true),
            ("64:ff9b::/96", "8.8.8.8", true),
            // The local-use prefix 64:ff9b:1::/48 is ordinary IPv6.
            ("8.8.8.8", "[64:ff9b:1::808:808]", false),
            ("64:ff9b:1::/48", "[64:ff9b:1::808:808]", true),
            // ... and :: and ::1 keep their IPv6 meaning.
            ("0.0.0.1", "[::1]", false),
            ("::1", "[64:ff9b::1]", false),
            ("0.0.0.0", "[::]", false),
            ("::/96", "[::1]", true),
            ("::/96", "[::10.0.0.1]", false),
            ("10.0.0.0/8", "[fd00::1]", false),
            ("fd00::/8", "[fd12:3456::1]", true),
            ("fd00::/8", "[fe80::1]", false),
            ("fd00::/8", "10.0.0.1", false),
            ("0.0.0.0/0", "8.8.8.8", true),
            ("::/0", "[2001:db8::1]", true),
            ("::/0", "8.8.8.8", false),
            // Raw hosts are normalized as a URL host would be.
            ("127.0.0.1", "0x7f.1", true),
            ("127.0.0.1", "2130706433", true),
            ("127.0.0.1", "0177.0.0.01", true),
            ("127.0.0.1", "%31%32%37.0.0.1", true),
            ("xn--bcher-kva.example", "bücher.example", true),
            ("bücher.example", "xn--bcher-kva.example", true),
            ("*", "", false),
            ("*", "[::1", false),
        ];
        for (l, host, allowed) in cases {
            assert_eq!(
                host_allowed(&list(l), host),
                *allowed,
                "list {l:?}, host {host:?}"
            );
        }
    }

    #[test]
    fn tricky_url_hosts_are_checked_as_normalized() {
        // What the url crate (and so reqwest) makes of hosts that do not look like their address.
        let normalized: &[(&str, &str)] = &[
            ("http://0x7f.1/", "127.0.0.1"),
            ("http://2130706433/", "127.0.0.1"),
            ("http://0177.0.0.1/", "127.0.0.1"),
            ("http://127.1/", "127.0.0.1"),
            ("http://0xa9.0xfe.0xa9.0xfe/", "169.254.169.254"),
            ("http://2852039166/", "169.254.169.254"),
            ("http://0251.0376.0251.0376/", "169.254.169.254"),
            ("http://%31%36%39.254.169.254/", "169.254.169.254"),
            ("http://[::ffff:169.254.169.254]/", "[::ffff:a9fe:a9fe]"),
            ("http://[64:ff9b::169.254.169.254]/", "[64:ff9b::a9fe:a9fe]"),
            ("http://[::169.254.169.254]/", "[::a9fe:a9fe]"),
            ("http://[0:0::A9FE:A9FE]/", "[::a9fe:a9fe]"),
            ("http://[FD00:EC2::254]/", "[fd00:ec2::254]"),
            ("http://0/", "0.0.0.0"),
            ("http://API.Example.COM./x", "api.example.com."),
            ("http://user:pw@api.example.com:8443/x", "api.example.com"),
        ];
        for (u, host) in normalized {
            assert_eq!(url_host(u), *host, "{u}");
        }
        let star = list("*");
        let refused_by_star = [
            "http://0xa9.0xfe.0xa9.0xfe/latest/meta-data",
            "http://2852039166/",
            "http://0251.0376.0251.0376/",
            "http://%31%36%39.254.169.254/",
            "http://169.254.169.254/",
            "http://169.254.0.1:8080/",
            "http://[::ffff:169.254.169.254]/",
            "http://[fd00:ec2::254]/",
            "http://[fe80::1]/",
            "http://[::]/",
            "http://0/",
            "http://0.0.0.0:5432/",
            "http://100.100.100.200/",
            "http://168.63.129.16/",
            "http://[::ffff:168.63.129.16]/",
            "http://[64:ff9b::a9fe:a9fe]/latest/meta-data",
            "http://[64:ff9b::169.254.169.254]/",
            "http://[64:FF9B:0:0:0:0:A9FE:A9FE]/",
            "http://[::169.254.169.254]/",
            "http://[::a9fe:a9fe]/",
            "http://[64:ff9b::]/",
            "http://[::0.0.0.2]/",
            "http://[64:ff9b::a83f:8110]/",
            "http://[::168.63.129.16]/",
        ];
        for u in refused_by_star {
            let url = url::Url::parse(u).unwrap();
            let r = check_url(&star, &url).expect_err(u);
            assert!(matches!(r.reason, Reason::Sensitive { .. }), "{u}: {r}");
            assert!(
                r.to_string()
                    .starts_with("destination refused by outbox.allowed_hosts: host "),
                "{r}"
            );
        }
        for u in [
            "http://0x7f.1/",
            "http://2130706433/",
            "http://127.0.0.1:8080/",
            "http://[::1]/",
            "https://api.example.com./x",
            "http://100.100.100.201/",
            "http://169.253.255.255/",
            "http://[fd00:ec2::253]/",
            "http://[64:ff9b::808:808]/",
            "http://[64:ff9b::7f00:1]/",
            "http://[::8.8.8.8]/",
            "http://[::127.0.0.1]/",
            "http://168.63.129.17/",
            "http://[64:ff9b:1::a9fe:a9fe]/",
            "http://[64:ff9b::1:a9fe:a9fe]/",
        ] {
            assert_eq!(
                check_url(&star, &url::Url::parse(u).unwrap()),
                Ok(()),
                "{u}"
            );
        }
        let only_local = list("127.0.0.1");
        assert_eq!(
            check_url(&only_local, &url::Url::parse("http://0x7f.1/").unwrap()),
            Ok(())
        );
        let r = check_url(&only_local, &url::Url::parse("http://localhost/").unwrap()).unwrap_err();
        assert_eq!(
            (r.host.as_str(), &r.reason),
            ("localhost", &Reason::NotListed)
        );
    }

    #[test]
    fn sensitive_ranges() {
        let sensitive = [
            "169.254.169.254",
            "169.254.0.0",
            "169.254.255.255",
            "100.100.100.200",
            "0.0.0.0",
            "0.255.255.255",
            "fe80::1",
            "febf:ffff::1",
            "fd00:ec2::254",
            "::",
            "::ffff:169.254.169.254",
            "::ffff:100.100.100.200",
            "::ffff:0.0.0.0",
            "168.63.129.16",
            "::ffff:168.63.129.16",
            "64:ff9b::a83f:8110",
            "::168.63.129.16",
            "64:ff9b::a9fe:a9fe",
            "::a9fe:a9fe",
            "64:ff9b::",
            "::2",
        ];
        for s in sensitive {
            assert!(sensitive_range(ip(s)).is_some(), "{s}");
        }
        let ordinary = [
            "169.253.255.255",
            "169.255.0.0",
            "100.100.100.199",
            "100.100.100.201",
            "1.0.0.0",
            "127.0.0.1",
            "10.0.0.1",
            "192.168.1.1",
            "8.8.8.8",
            "fec0::1",
            "fe7f:ffff::1",
            "fd00:ec2::253",
            "fd00:ec2::255",
            "::1",
            "::ffff:127.0.0.1",
            "2001:db8::1",
            "168.63.129.15",
            "168.63.129.17",
            "64:ff9b::808:808",
            "64:ff9b::7f00:1",
            "::8.8.8.8",
            "::127.0.0.1",
            "64:ff9b:1::a9fe:a9fe",
            "64:ff9b::1:a9fe:a9fe",
            "64:ff9a::a9fe:a9fe",
            "::1:a9fe:a9fe",
        ];
        for s in ordinary {
            assert!(sensitive_range(ip(s)).is_none(), "{s}");
        }
    }

    #[test]
    fn addresses_against_lists() {
        // (list, address, allowed)
        let cases: &[(&str, &str, bool)] = &[
            ("*", "93.184.216.34", true),
            ("*", "127.0.0.1", true),
            ("*", "10.0.0.1", true),
            ("*", "169.254.169.254", false),
            ("*", "100.100.100.200", false),
            ("*", "0.0.0.0", false),
            ("*", "fe80::1", false),
            ("*", "fd00:ec2::254", false),
            ("*", "::", false),
            ("*", "::ffff:169.254.169.254", false),
            ("*", "::ffff:0.0.0.0", false),
            ("*", "168.63.129.16", false),
            ("*", "64:ff9b::a9fe:a9fe", false),
            ("*", "::a9fe:a9fe", false),
            ("*", "64:ff9b::808:808", true),
            ("*", "::8.8.8.8", true),
            ("*", "::1", true),
            ("*", "64:ff9b:1::a9fe:a9fe", true),
            // Host names never unlock a sensitive address, not even one that names it.
            ("metadata.google.internal", "169.254.169.254", false),
            ("*.internal", "169.254.169.254", false),
            ("", "169.254.169.254", false),
            // Non-sensitive addresses pass once the host passed, whatever the list.
            ("", "93.184.216.34", true),
            ("api.example.com", "10.0.0.1", true),
            // An IP or CIDR entry unlocks what it covers.
            ("169.254.169.254", "169.254.169.254", true),
            ("169.254.169.254", "169.254.169.253", false),
            ("169.254.169.254", "::ffff:169.254.169.254", true),
            ("::ffff:169.254.169.254", "169.254.169.254", true),
            // ... in any of its forms, written in any of them.
            ("169.254.169.254", "64:ff9b::a9fe:a9fe", true),
            ("169.254.169.254", "::a9fe:a9fe", true),
            ("64:ff9b::a9fe:a9fe", "169.254.169.254", true),
            ("::169.254.169.254", "::ffff:169.254.169.254", true),
            ("169.254.0.0/16", "64:ff9b::a9fe:102", true),
            ("64:ff9b::a9fe:0/112", "::169.254.1.2", true),
            ("168.63.129.16", "168.63.129.16", true),
            ("168.63.129.16/32", "64:ff9b::a83f:8110", true),
            ("::/0", "::", false),
            ("::", "64:ff9b::", false),
            ("0.0.0.0", "64:ff9b::", true),
            ("0.0.0.0/8", "::2", true),
            ("169.254.0.0/16", "169.254.1.2", true),
            ("169.254.169.0/24", "169.254.169.254", true),
            ("169.254.169.0/24", "169.254.170.1", false),
            ("100.100.100.200", "100.100.100.200", true),
            ("100.100.100.200/32", "100.100.100.200", true),
            ("0.0.0.0", "0.0.0.0", true),
            ("fe80::/10", "fe80::1", true),
            ("fe80::/64", "fe80::1", true),
            ("fd00:ec2::254", "fd00:ec2::254", true),
            ("[fd00:ec2::254]", "fd00:ec2::254", true),
            ("::", "::", true),
            // ... but a block wider than the refused range does not.
            ("0.0.0.0/0", "169.254.169.254", false),
            ("128.0.0.0/1", "169.254.169.254", false),
            ("169.0.0.0/8", "169.254.169.254", false),
            ("100.100.100.0/24", "100.100.100.200", false),
            ("0.0.0.0/0", "0.0.0.0", false),
            ("::/0", "fe80::1", false),
            ("fd00::/8", "fd00:ec2::254", false),
            ("fe80::/9", "fe80::1", false),
            ("::/0", "::", false),
            ("168.63.0.0/16", "168.63.129.16", false),
            ("64:ff9b::/96", "64:ff9b::a9fe:a9fe", false),
            ("::/0", "64:ff9b::a9fe:a9fe", false),
            ("64:ff9b::/64", "64:ff9b::a9fe:a9fe", false),
            ("*, 10.0.0.0/8", "169.254.169.254", false),
        ];
        for (l, a, allowed) in cases {
            assert_eq!(
                address_allowed(&list(l), ip(a)),
                *allowed,
                "list {l:?}, address {a}"
            );
        }
    }

    #[test]
    fn literal_hosts_need_both_checks() {
        let cases: &[(&str, &str, bool)] = &[
            ("*", "http://169.254.169.254/latest", false),
            ("169.254.169.254", "http://169.254.169.254/latest", true),
            ("169.254.0.0/16", "http://169.254.169.254/latest", true),
            ("0.0.0.0/0", "http://169.254.169.254/latest", false),
            ("0.0.0.0/0", "http://10.0.0.1/", true),
            ("api.example.com", "http://10.0.0.1/", false),
            ("*.example.com", "http://api.example.com/", true),
            ("*.example.com", "http://example.com/", false),
            ("", "http://api.example.com/", false),
        ];
        for (l, u, allowed) in cases {
            let url = url::Url::parse(u).unwrap();
            assert_eq!(
                check_url(&list(l), &url).is_ok(),
                *allowed,
                "list {l:?}, url {u}"
            );
        }
    }

    #[test]
    fn resolved_addresses_are_filtered() {
        let sa = |s: &str| SocketAddr::new(ip(s), 0);
        let star = list("*");
        assert_eq!(
            filter_resolved(
                &star,
                "api.example.com",
                [sa("93.184.216.34"), sa("169.254.169.254")]
            ),
            Ok(vec![sa("93.184.216.34")])
        );
        assert_eq!(
            filter_resolved(&star, "both.example.com", [sa("::1"), sa("127.0.0.1")]),
            Ok(vec![sa("::1"), sa("127.0.0.1")])
        );
        let r = filter_resolved(
            &star,
            "metadata.example.com.",
            [
                sa("169.254.169.254"),
                sa("::ffff:169.254.169.254"),
                sa("fd00:ec2::254"),
            ],
        )
        .unwrap_err();
        assert_eq!(r.host, "metadata.example.com");
        assert_eq!(
            r.reason,
            Reason::OnlySensitiveAddresses {
                addresses: vec![ip("169.254.169.254"), ip("fd00:ec2::254")]
            }
        );
        assert_eq!(
            r.to_string(),
            "destination refused by outbox.allowed_hosts: host metadata.example.com resolves only to refused addresses (169.254.169.254, fd00:ec2::254)"
        );
        let unlocked = list("*.example.com, 169.254.169.254");
        assert_eq!(
            filter_resolved(&unlocked, "metadata.example.com", [sa("169.254.169.254")]),
            Ok(vec![sa("169.254.169.254")])
        );
        let r = filter_resolved(
            &list("api.example.com"),
            "other.example.com",
            [sa("1.2.3.4")],
        )
        .unwrap_err();
        assert_eq!(r.reason, Reason::NotListed);
        assert_eq!(
            r.to_string(),
            "destination refused by outbox.allowed_hosts: host other.example.com is not listed"
        );
        assert_eq!(filter_resolved(&star, "empty.example.com", []), Ok(vec![]));
    }

    #[test]
    fn refusals_explain_themselves() {
        let r = check_url(
            &list("*"),
            &url::Url::parse("http://169.254.169.254/").unwrap(),
        )
        .unwrap_err();
        assert_eq!(r.host, "169.254.169.254");
        assert!(r.to_string().starts_with(
            "destination refused by outbox.allowed_hosts: host 169.254.169.254 is IPv4 link-local"
        ));
        assert!(
            r.explanation().contains("IP or CIDR entry"),
            "{}",
            r.explanation()
        );
        let r = check_url(&list("*"), &url::Url::parse("http://[fe80::1]/").unwrap()).unwrap_err();
        assert_eq!(r.host, "[fe80::1]");
        let r = check_url(&list(""), &url::Url::parse("http://a.example/").unwrap()).unwrap_err();
        assert!(r.explanation().contains("matches no entry"));
    }

    #[test]
    fn networks() {
        let n = Network::new(ip("10.0.0.0"), 8).unwrap();
        assert!(n.contains(ip("10.255.255.255")));
        assert!(!n.contains(ip("11.0.0.0")));
        assert!(!n.contains(ip("::ffff:10.0.0.1"))); // callers pass canonical addresses
        assert_eq!(n.to_string(), "10.0.0.0/8");
        let all4 = Network::new(ip("0.0.0.0"), 0).unwrap();
        assert!(all4.contains(ip("255.255.255.255")));
        assert!(!all4.contains(ip("::1")));
        let one = Network::new(ip("::1"), 128).unwrap();
        assert!(one.contains(ip("::1")) && !one.contains(ip("::2")));
        assert!(Network::new(ip("10.0.0.1"), 8).is_err());
        assert!(Network::new(ip("10.0.0.0"), 33).is_err());
        assert_eq!(
            Network::new(ip("::ffff:10.0.0.0"), 104).unwrap(),
            Network::new(ip("10.0.0.0"), 8).unwrap()
        );
        assert_eq!(
            Network::new(ip("64:ff9b::a00:0"), 104).unwrap(),
            Network::new(ip("10.0.0.0"), 8).unwrap()
        );
        assert_eq!(
            Network::new(ip("::a00:0"), 104).unwrap(),
            Network::new(ip("10.0.0.0"), 8).unwrap()
        );
        assert_eq!(
            Network::new(ip("::2"), 127).unwrap(),
            Network::new(ip("0.0.0.2"), 31).unwrap()
        );
        for p in [96, 104, 127, 128] {
            let n = Network::new(ip("::"), p).unwrap();
            assert_eq!(n.addr(), ip("::"), "::/{p}");
            assert!(n.contains(ip("::")), "::/{p}");
        }
        assert!(Network::new(ip("::"), 127).unwrap().contains(ip("::1")));
        assert_eq!(Network::new(ip("::1"), 128).unwrap().addr(), ip("::1"));
        let local_use = Network::new(ip("64:ff9b:1::"), 96).unwrap();
        assert_eq!(local_use.to_string(), "64:ff9b:1::/96");
    }

    #[test]
    fn embedded_ipv4_addresses_are_canonical() {
        // (address, canonical)
        let cases: &[(&str, &str)] = &[
            ("::ffff:169.254.169.254", "169.254.169.254"),
            ("64:ff9b::a9fe:a9fe", "169.254.169.254"),
            ("64:ff9b::169.254.169.254", "169.254.169.254"),
            ("64:ff9b::7f00:1", "127.0.0.1"),
            ("64:ff9b::808:808", "8.8.8.8"),
            ("64:ff9b::", "0.0.0.0"),
            ("64:ff9b::ffff:ffff", "255.255.255.255"),
            ("::a9fe:a9fe", "169.254.169.254"),
            ("::169.254.169.254", "169.254.169.254"),
            ("::8.8.8.8", "8.8.8.8"),
            ("::2", "0.0.0.2"),
            ("::ffff:ffff", "255.255.255.255"),
            // Not embedded: the unspecified and loopback addresses ...
            ("::", "::"),
            ("::1", "::1"),
            ("::0.0.0.1", "::1"),
            // ... outside the /96 prefixes ...
            ("64:ff9b::1:a9fe:a9fe", "64:ff9b::1:a9fe:a9fe"),
            ("64:ff9b:0:0:1::a9fe:a9fe", "64:ff9b:0:0:1:0:a9fe:a9fe"),
            ("64:ff9a::a9fe:a9fe", "64:ff9a::a9fe:a9fe"),
            ("::1:a9fe:a9fe", "::1:a9fe:a9fe"),
            ("::fffe:a9fe:a9fe", "::fffe:a9fe:a9fe"),
            // ... and the local-use NAT64 prefix (see embedded_ipv4).
            ("64:ff9b:1::a9fe:a9fe", "64:ff9b:1::a9fe:a9fe"),
            ("64:ff9b:1:ffff::a9fe:a9fe", "64:ff9b:1:ffff::a9fe:a9fe"),
            ("169.254.169.254", "169.254.169.254"),
            ("fe80::1", "fe80::1"),
        ];
        for (a, c) in cases {
            assert_eq!(canonical(ip(a)), ip(c), "{a}");
        }
    }

    /// The NAT64 (64:ff9b::/96) and IPv4-compatible (::/96) forms of an IPv4 address.
    fn embedded_forms(v4: Ipv4Addr) -> [(&'static str, Ipv6Addr); 2] {
        let low = u128::from(u32::from(v4));
        [
            ("NAT64", Ipv6Addr::from((NAT64_WELL_KNOWN << 32) | low)),
            ("IPv4-compatible", Ipv6Addr::from(low)),
        ]
    }

    #[test]
    fn every_refused_ipv4_range_is_refused_in_every_form() {
        let v4_ranges: Vec<(&SensitiveRange, Ipv4Addr, u8)> = SENSITIVE
            .iter()
            .filter_map(|r| match r.network.addr() {
                IpAddr::V4(a) => Some((r, a, r.network.prefix())),
                IpAddr::V6(_) => None,
            })
            .collect();
        assert!(
            v4_ranges
                .iter()
                .any(|(_, a, p)| *a == Ipv4Addr::new(168, 63, 129, 16) && *p == 32),
            "Azure's address is a refused range"
        );
        assert!(v4_ranges.len() >= 4, "{v4_ranges:?}");
        let star = list("*");
        let by_name = list("*.example.com");
        for (range, base, prefix) in v4_ranges {
            let first = u32::from(base);
            let last = first | (u32::MAX.checked_shr(u32::from(prefix)).unwrap_or(0));
            let samples = [first, first + (last - first) / 2, last];
            for v4 in samples.map(Ipv4Addr::from) {
                let unlocked_by_address = list(&v4.to_string());
                let unlocked_by_range = list(&range.network.to_string());
                for (form, v6) in embedded_forms(v4) {
                    let a = IpAddr::V6(v6);
                    let case = format!("{v4} in {} as {form} {v6}", range.network);
                    if u128::from(v6) <= 1 {
                        // ::0.0.0.0 and ::0.0.0.1 are :: and ::1, checked as such below.
                        continue;
                    }
                    assert_eq!(canonical(a), IpAddr::V4(v4), "{case}");
                    assert_eq!(sensitive_range(a), Some(range), "{case}");
                    assert!(!address_allowed(&star, a), "{case}");
                    // A literal host: refused, named as written, with its range.
                    let host = format!("[{v6}]");
                    let url = url::Url::parse(&format!("http://{host}/")).unwrap();
                    let r = check_url(&star, &url).expect_err(&case);
                    assert_eq!(r.host, host, "{case}");
                    assert_eq!(
                        r.reason,
                        Reason::Sensitive {
                            address: IpAddr::V4(v4),
                            what: range.what
                        },
                        "{case}"
                    );
                    assert_eq!(
                        r.to_string(),
                        format!(
                            "destination refused by outbox.allowed_hosts: host {host} is {}",
                            range.what
                        ),
                        "{case}"
                    );
                    // A resolved address: dropped, and reported as the IPv4 address.
                    let sa = SocketAddr::new(a, 443);
                    let r = filter_resolved(&by_name, "x.example.com", [sa]).expect_err(&case);
                    assert_eq!(
                        r.reason,
                        Reason::OnlySensitiveAddresses {
                            addresses: vec![IpAddr::V4(v4)]
                        },
                        "{case}"
                    );
                    // An entry naming the IPv4 address or its range unlocks every form.
                    assert!(address_allowed(&unlocked_by_address, a), "{case}");
                    assert!(address_allowed(&unlocked_by_range, a), "{case}");
                    assert_eq!(check_url(&unlocked_by_address, &url), Ok(()), "{case}");
                    let mapped = IpAddr::V6(v4.to_ipv6_mapped());
                    assert!(address_allowed(&list(&v6.to_string()), mapped), "{case}");
                    assert!(
                        address_allowed(&list(&v6.to_string()), IpAddr::V4(v4)),
                        "{case}"
                    );
                }
            }
            // Just outside the range, each form means what the IPv4 address means.
            for v4 in [first.checked_sub(1), last.checked_add(1)]
                .into_iter()
                .flatten()
                .map(Ipv4Addr::from)
            {
                for (form, v6) in embedded_forms(v4) {
                    assert_eq!(
                        sensitive_range(IpAddr::V6(v6)),
                        sensitive_range(IpAddr::V4(v4)),
                        "{v4} next to {} as {form} {v6}",
                        range.network
                    );
                }
            }
        }
    }

    #[test]
    fn azure_platform_address_is_refused_in_every_form() {
        let star = list("*");
        for (u, host) in [
            (
                "http://168.63.129.16/machine?comp=goalstate",
                "168.63.129.16",
            ),
            ("http://[::ffff:168.63.129.16]/", "[::ffff:168.63.129.16]"),
            ("http://[::ffff:a83f:8110]/", "[::ffff:168.63.129.16]"),
            ("http://[64:ff9b::168.63.129.16]/", "[64:ff9b::a83f:8110]"),
            ("http://[::168.63.129.16]/", "[::a83f:8110]"),
        ] {
            let r = check_url(&star, &url::Url::parse(u).unwrap()).expect_err(u);
            assert_eq!(r.host, host, "{u}");
            assert_eq!(
                r.to_string(),
                format!(
                    "destination refused by outbox.allowed_hosts: host {host} is the Azure platform address (WireServer), which serves the VM's goal state and certificates"
                ),
                "{u}"
            );
            assert!(r
                .explanation()
                .starts_with("168.63.129.16 is the Azure platform address"));
            assert_eq!(
                check_url(&list("*, 168.63.129.16"), &url::Url::parse(u).unwrap()),
                Ok(()),
                "{u}"
            );
        }
        let r = filter_resolved(
            &star,
            "wire.example.com",
            [
                SocketAddr::new(ip("168.63.129.16"), 80),
                SocketAddr::new(ip("::ffff:168.63.129.16"), 80),
                SocketAddr::new(ip("64:ff9b::a83f:8110"), 80),
                SocketAddr::new(ip("::a83f:8110"), 80),
            ],
        )
        .unwrap_err();
        assert_eq!(
            r.reason,
            Reason::OnlySensitiveAddresses {
                addresses: vec![ip("168.63.129.16")]
            }
        );
    }

    #[test]
    fn embedded_forms_of_ordinary_addresses_stay_allowed() {
        let star = list("*");
        let sa = |s: &str| SocketAddr::new(ip(s), 443);
        // Kept in the form resolved: the guard does not rewrite what is connected to.
        let resolved = [
            sa("64:ff9b::808:808"),
            sa("::8.8.8.8"),
            sa("64:ff9b::7f00:1"),
            sa("::1"),
            sa("64:ff9b:1::a9fe:a9fe"),
            sa("64:ff9b::a9fe:a9fe"),
        ];
        assert_eq!(
            filter_resolved(&star, "api.example.com", resolved),
            Ok(resolved[..5].to_vec())
        );
        // 64:ff9b::7f00:1 is 127.0.0.1: allowed where 127.0.0.1 is, not where ::1 is.
        assert_eq!(
            check_url(
                &list("127.0.0.1"),
                &url::Url::parse("http://[64:ff9b::7f00:1]/").unwrap()
            ),
            Ok(())
        );
        let r = check_url(
            &list("::1"),
            &url::Url::parse("http://[64:ff9b::7f00:1]/").unwrap(),
        )
        .unwrap_err();
        assert_eq!(
            (r.host.as_str(), &r.reason),
            ("[64:ff9b::7f00:1]", &Reason::NotListed)
        );
        // ::1 is the IPv6 loopback, unchanged: not sensitive, listed by ::1 only.
        assert_eq!(canonical(ip("::1")), ip("::1"));
        assert_eq!(sensitive_range(ip("::1")), None);
        let loopback = url::Url::parse("http://[::1]:8080/").unwrap();
        assert_eq!(check_url(&star, &loopback), Ok(()));
        assert_eq!(check_url(&list("::1"), &loopback), Ok(()));
        assert_eq!(
            check_url(&list("127.0.0.1, 0.0.0.1"), &loopback)
                .unwrap_err()
                .reason,
            Reason::NotListed
        );
        // :: is the IPv6 unspecified address, refused as such, not as 0.0.0.0.
        assert_eq!(canonical(ip("::")), ip("::"));
        let r = check_url(&star, &url::Url::parse("http://[::]/").unwrap()).unwrap_err();
        assert_eq!(r.host, "[::]");
        assert_eq!(
            r.reason,
            Reason::Sensitive {
                address: ip("::"),
                what: "the IPv6 unspecified address, which reaches the local host"
            }
        );
        assert!(address_allowed(&list("::"), ip("::")));
        assert!(!address_allowed(&list("0.0.0.0"), ip("::")));
    }

    /// Every IPv6 spelling of an IPv4 address that a connection would reach it by: those
    /// that stand for it (mapped, translated, NAT64, compatible) and the tunnels (6to4 at
    /// both ends of its /48, Teredo as server and as client behind an ordinary server).
    fn ipv6_spellings(v4: Ipv4Addr) -> Vec<Ipv6Addr> {
        let n = u128::from(u32::from(v4));
        let teredo_server = u128::from(u32::from(Ipv4Addr::new(65, 54, 227, 120)));
        let mut forms = vec![
            0xffff_0000_0000 | n,
            0xffff_0000_0000_0000 | n,
            NAT64_WELL_KNOWN << 32 | n,
            (SIX_TO_FOUR << 112) | (n << 80),
            (SIX_TO_FOUR << 112) | (n << 80) | 0xffff_ffff_ffff_ffff_ffff,
            (SIX_TO_FOUR << 112) | (n << 80) | 1,
            (TEREDO << 96) | (n << 64) | 0x8000_63bf_3fff_fdd2,
            (TEREDO << 96) | (teredo_server << 64) | 0x8000_63bf_0000_0000 | (!n & 0xffff_ffff),
            (TEREDO << 96) | (teredo_server << 64) | (!n & 0xffff_ffff),
        ];
        // ::a.b.c.d, but :: and ::1 are IPv6 addresses of their own.
        if n > 1 {
            forms.push(n);
        }
        forms.into_iter().map(Ipv6Addr::from).collect()
    }

    /// The IPv4 addresses of every refused range: its first, last and a middle address, and
    /// the cloud metadata addresses themselves.
    fn refused_ipv4() -> Vec<Ipv4Addr> {
        let mut all = vec![Ipv4Addr::new(169, 254, 169, 254)];
        for r in SENSITIVE {
            if let IpAddr::V4(a) = r.network.addr() {
                let first = u32::from(a);
                let size = 1u64 << (32 - u32::from(r.network.prefix()));
                let last = (u64::from(first) + size - 1) as u32;
                all.extend([first, first + ((last - first) / 2), last].map(Ipv4Addr::from));
            }
        }
        all
    }

    #[test]
    fn every_ipv6_spelling_of_a_refused_ipv4_address_is_refused() {
        let star = list("*");
        for v4 in refused_ipv4() {
            let range = sensitive_range(IpAddr::V4(v4)).expect("a refused address");
            for v6 in ipv6_spellings(v4) {
                let ip6 = IpAddr::V6(v6);
                assert!(!address_allowed(&star, ip6), "{v6} reaches {v4}");
                assert_eq!(sensitive_range(ip6), Some(range), "{v6} reaches {v4}");
                let url = url::Url::parse(&format!("http://[{v6}]/")).unwrap();
                let refusal = check_url(&star, &url).unwrap_err();
                assert!(
                    matches!(refusal.reason, Reason::Sensitive { .. }),
                    "{v6}: {refusal}"
                );
                // The address it reaches, as the entry of an administrator who means it,
                // unlocks every spelling of it.
                let entry = list(&v4.to_string());
                assert!(address_allowed(&entry, ip6), "{v6} under the entry {v4}");
            }
        }
    }

    #[test]
    fn the_same_spellings_of_an_ordinary_address_pass() {
        let star = list("*");
        for v4 in [
            Ipv4Addr::new(93, 184, 216, 34),
            Ipv4Addr::new(8, 8, 8, 8),
            Ipv4Addr::new(169, 253, 255, 255),
            Ipv4Addr::new(169, 255, 0, 0),
            Ipv4Addr::new(1, 0, 0, 0),
        ] {
            for v6 in ipv6_spellings(v4) {
                assert!(address_allowed(&star, IpAddr::V6(v6)), "{v6} reaches {v4}");
            }
        }
    }

    #[test]
    fn the_metadata_address_in_the_spellings_the_review_found() {
        for s in [
            "::ffff:0:169.254.169.254",
            "::ffff:0:a9fe:a9fe",
            "2002:a9fe:a9fe::",
            "2002:a9fe:a9fe:ffff::1",
            "2001:0:a9fe:a9fe::1",
            "2001:0:4136:e378:8000:63bf:5601:5601",
        ] {
            assert!(!address_allowed(&list("*"), ip(s)), "{s}");
            let r = check_url(
                &list("*"),
                &url::Url::parse(&format!("http://[{s}]/")).unwrap(),
            )
            .unwrap_err();
            assert_eq!(
                r.reason,
                Reason::Sensitive {
                    address: ip("169.254.169.254"),
                    what: "IPv4 link-local, which holds the cloud metadata address 169.254.169.254"
                },
                "{s}"
            );
        }
        // The translated form stands for the IPv4 address, as the mapped one does.
        assert_eq!(canonical(ip("::ffff:0:a9fe:a9fe")), ip("169.254.169.254"));
        // A tunnel's address does not stand for the one address it reaches.
        assert_eq!(canonical(ip("2002:a9fe:a9fe::")), ip("2002:a9fe:a9fe::"));
        // 6to4 of an ordinary address, Teredo of an ordinary server and client, and the
        // prefixes beside them pass.
        for s in [
            "2002:808:808::1",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "2003:a9fe:a9fe::",
            "2001:1:a9fe:a9fe::1",
            "2001:db8:a9fe:a9fe::1",
        ] {
            assert!(address_allowed(&list("*"), ip(s)), "{s}");
        }
    }

    #[test]
    fn a_tunnel_address_is_unlocked_by_what_it_reaches_or_by_a_narrow_block_of_its_own() {
        // (list, address, allowed)
        let cases: &[(&str, &str, bool)] = &[
            ("169.254.169.254", "2002:a9fe:a9fe::1", true),
            ("169.254.0.0/16", "2002:a9fe:102::", true),
            ("0.0.0.0/0", "2002:a9fe:a9fe::1", false),
            ("2002:a9fe:a9fe::1", "2002:a9fe:a9fe::1", true),
            ("2002:a9fe:a9fe::1", "2002:a9fe:a9fe::2", false),
            ("2002:a9fe:a9fe::/48", "2002:a9fe:a9fe::2", true),
            // 16 bits of 6to4, then the 16 that make 169.254/16.
            ("2002:a9fe::/32", "2002:a9fe:a9fe::2", true),
            ("2002:a9fe::/31", "2002:a9fe:a9fe::2", false),
            ("2002::/16", "2002:a9fe:a9fe::", false),
            ("::/0", "2002:a9fe:a9fe::", false),
            // Teredo: both ends must be unlocked, each by what reaches it.
            ("169.254.169.254", "2001:0:a9fe:a9fe::1", true),
            (
                "169.254.169.254",
                "2001:0:4136:e378:8000:63bf:5601:5601",
                true,
            ),
            (
                "169.254.169.254",
                "2001:0:a9fe:a9fe:8000:63bf:5601:5601",
                true,
            ),
            ("169.254.169.254", "2001::5601:5601", false),
            ("169.254.169.254, 0.0.0.0/8", "2001::5601:5601", true),
            ("2001:0:a9fe::/48", "2001:0:a9fe:a9fe::1", true),
            ("2001:0::/32", "2001:0:a9fe:a9fe::1", false),
            (
                "2001:0:4136:e378:8000:63bf:5601:5601",
                "2001:0:4136:e378:8000:63bf:5601:5601",
                true,
            ),
            // The translated form, written either way.
            ("::ffff:0:a9fe:a9fe", "169.254.169.254", true),
            ("169.254.169.254", "::ffff:0:169.254.169.254", true),
            ("::ffff:0:a9fe:0/112", "169.254.1.2", true),
            ("::ffff:0:0:0/96", "::ffff:0:a9fe:a9fe", false),
        ];
        for (l, a, allowed) in cases {
            assert_eq!(address_allowed(&list(l), ip(a)), *allowed, "{l} / {a}");
        }
    }
}
