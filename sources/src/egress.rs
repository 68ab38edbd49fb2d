//! Where a source may connect (design invariant 6: "a source never reaches loopback,
//! link-local, private or cluster-internal addresses unless an admin allowed them, checked on
//! the resolved address of every connection and redirect").
//!
//! The check is on addresses, at connect time, not on names: a name that resolves to
//! `127.0.0.1` (or that resolves to a public address when the policy looks and to a private
//! one when the client connects: DNS rebinding) is caught because the only addresses a
//! client gets are the ones [`GuardedResolver`] already filtered. An address written in a URL
//! (`https://169.254.169.254/`) never goes through a resolver, so every URL a client is
//! about to use, the first and every redirect hop, has its literal host checked too
//! ([`Egress::check_url`]). Proxies are off in these clients: through a proxy the address
//! check would be the proxy's.
//!
//! Refused by default: unspecified, loopback, link-local (169.254/16, fe80::/10), private
//! (10/8, 172.16/12, 192.168/16, fc00::/7), CGNAT (100.64/10), "this network" (0/8),
//! broadcast, multicast, documentation and benchmark ranges, and the cluster's service and pod
//! ranges (`--cluster-network`). An admin allows ranges with `--allow-source-network`
//! (`operator.sources.allowNetworks`), which wins over every refusal.

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;

use ipnet::IpNet;
use object_store::ClientOptions;
use object_store::client::{
    ClientConfigKey, HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest,
    HttpResponse, HttpService,
};
use url::Url;

/// `sealed-operator run|sync` flag (repeatable): an address range sources may reach although
/// it is loopback, link-local, private or a cluster range.
pub const ALLOW_NETWORK_FLAG: &str = "--allow-source-network";
/// `sealed-operator run|sync` flag (repeatable): the cluster's service and pod ranges,
/// refused to sources like the private ranges (they may be public addresses).
pub const CLUSTER_NETWORK_FLAG: &str = "--cluster-network";

/// The address ranges sources may and may not reach.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Egress {
    /// Reachable although refused by default (`--allow-source-network`).
    pub allowed: Vec<IpNet>,
    /// Refused besides the defaults: the cluster's service and pod ranges
    /// (`--cluster-network`).
    pub cluster: Vec<IpNet>,
}

/// A connection refused by the [`Egress`] policy. Found in an error's source chain and turned
/// into a `SourceRefused` condition ([`refused_in`]).
#[derive(Clone, Debug, thiserror::Error)]
#[error(
    "{target} is {why} ({addr}), which sources may not reach; a cluster admin can allow the range \
     with {ALLOW_NETWORK_FLAG} (chart: operator.sources.allowNetworks)"
)]
pub struct EgressRefused {
    /// The host (and port) as the URL named it.
    pub target: String,
    pub addr: IpAddr,
    pub why: &'static str,
}

impl Egress {
    /// Why `addr` is refused, `None` when a source may connect to it.
    pub fn refusal(&self, addr: IpAddr) -> Option<&'static str> {
        // ::ffff:10.0.0.1 is 10.0.0.1 on the wire.
        let addr = addr.to_canonical();
        if self.allowed.iter().any(|n| n.contains(&addr)) {
            return None;
        }
        if self.cluster.iter().any(|n| n.contains(&addr)) {
            return Some("in a cluster service or pod range");
        }
        default_refusal(addr)
    }

    /// Refuses `addr` for `target` (what the URL said).
    pub fn check(&self, target: &str, addr: IpAddr) -> Result<(), EgressRefused> {
        match self.refusal(addr) {
            None => Ok(()),
            Some(why) => Err(EgressRefused {
                target: target.to_owned(),
                addr,
                why,
            }),
        }
    }

    /// Checks a URL whose host is an address (names are checked when they resolve).
    pub fn check_url(&self, url: &Url) -> Result<(), EgressRefused> {
        let addr = match url.host() {
            Some(url::Host::Ipv4(a)) => IpAddr::V4(a),
            Some(url::Host::Ipv6(a)) => IpAddr::V6(a),
            _ => return Ok(()),
        };
        self.check(&host_port(url), addr)
    }

    /// A policy that allows `networks` (CIDRs or addresses), e.g. loopback for tests whose
    /// servers listen there.
    pub fn allowing(networks: &[&str]) -> Result<Egress, String> {
        let networks: Vec<String> = networks.iter().map(|n| (*n).to_owned()).collect();
        Ok(Egress {
            allowed: Egress::parse_networks(&networks, ALLOW_NETWORK_FLAG)?,
            cluster: Vec::new(),
        })
    }

    /// Parses the flags' values (CIDRs, or single addresses).
    pub fn parse_networks(values: &[String], flag: &str) -> Result<Vec<IpNet>, String> {
        values
            .iter()
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
            .map(|v| {
                v.parse::<IpNet>()
                    .or_else(|_| v.parse::<IpAddr>().map(IpNet::from))
                    .map_err(|_| {
                        format!("{flag} {v:?} is not an address range (10.96.0.0/12, fd00::/8)")
                    })
            })
            .collect()
    }
}

/// `host[:port]` of a URL, for messages (no user, path or query).
fn host_port(url: &Url) -> String {
    match (url.host_str(), url.port()) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        (Some(h), None) => h.to_owned(),
        _ => String::new(),
    }
}

/// Why an address is refused without an admin's allow-list entry.
fn default_refusal(addr: IpAddr) -> Option<&'static str> {
    match addr {
        IpAddr::V4(a) => {
            let [b0, b1, ..] = a.octets();
            if a.is_unspecified() || b0 == 0 {
                Some("an unspecified or this-network address")
            } else if a.is_loopback() {
                Some("a loopback address")
            } else if a.is_link_local() {
                Some("a link-local address")
            } else if a.is_private() {
                Some("a private address")
            } else if b0 == 100 && (b1 & 0xc0) == 64 {
                Some("a carrier-grade NAT address")
            } else if a.is_multicast() || a.is_broadcast() || b0 >= 240 {
                Some("a multicast, broadcast or reserved address")
            } else if a.is_documentation() || (b0 == 198 && (b1 & 0xfe) == 18) {
                Some("a documentation or benchmarking address")
            } else if b0 == 192 && b1 == 0 && a.octets()[2] == 0 {
                Some("an IETF protocol address")
            } else {
                None
            }
        }
        IpAddr::V6(a) => {
            let s0 = a.segments()[0];
            if a.is_unspecified() {
                Some("an unspecified address")
            } else if a.is_loopback() {
                Some("a loopback address")
            } else if (s0 & 0xffc0) == 0xfe80 || (s0 & 0xffc0) == 0xfec0 {
                Some("a link-local address")
            } else if (s0 & 0xfe00) == 0xfc00 {
                Some("a private (unique local) address")
            } else if a.is_multicast() {
                Some("a multicast address")
            } else if s0 == 0x2001 && a.segments()[1] == 0x0db8 {
                Some("a documentation address")
            } else if a.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                // NAT64 of an IPv4 address: judged as that address.
                let [.., hi, lo] = a.segments();
                let v4 = std::net::Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
                default_refusal(IpAddr::V4(v4))
            } else {
                None
            }
        }
    }
}

/// What resolves names for a [`GuardedResolver`]: the system's resolver, or a table in tests.
pub type Lookup = Arc<
    dyn Fn(String) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<IpAddr>>> + Send>>
        + Send
        + Sync,
>;

/// A reqwest resolver that hands the client only addresses the [`Egress`] policy admits: the
/// client can connect to nothing else, whatever the name resolves to at that moment.
#[derive(Clone)]
pub struct GuardedResolver {
    egress: Arc<Egress>,
    lookup: Lookup,
}

impl GuardedResolver {
    /// Over the system's resolver.
    pub fn new(egress: Arc<Egress>) -> GuardedResolver {
        GuardedResolver::with_lookup(
            egress,
            Arc::new(|name: String| {
                Box::pin(async move {
                    let addrs = tokio::net::lookup_host((name.as_str(), 0)).await?;
                    Ok(addrs.map(|a| a.ip()).collect())
                })
            }),
        )
    }

    /// Over `lookup` (tests: a name that resolves to a private address).
    pub fn with_lookup(egress: Arc<Egress>, lookup: Lookup) -> GuardedResolver {
        GuardedResolver { egress, lookup }
    }
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let (egress, lookup) = (self.egress.clone(), self.lookup.clone());
        let name = name.as_str().to_owned();
        Box::pin(async move {
            let resolved = lookup(name.clone()).await?;
            let mut first_refusal = None;
            let mut admitted = Vec::new();
            for addr in resolved {
                match egress.check(&name, addr) {
                    Ok(()) => admitted.push(SocketAddr::new(addr, 0)),
                    Err(e) => {
                        first_refusal.get_or_insert(e);
                    }
                }
            }
            if admitted.is_empty() {
                return Err(match first_refusal {
                    Some(e) => Box::new(e) as Box<dyn std::error::Error + Send + Sync>,
                    None => format!("{name} resolves to no address").into(),
                });
            }
            Ok(Box::new(admitted.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// A redirect policy that checks each hop's literal address (names are checked by the
/// resolver when the hop connects), at most `max` hops.
pub fn redirect_policy(egress: Arc<Egress>, max: usize) -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= max {
            return attempt.error(format!("more than {max} redirects"));
        }
        match egress.check_url(attempt.url()) {
            Ok(()) => attempt.follow(),
            Err(e) => attempt.error(e),
        }
    })
}

/// The [`EgressRefused`] in `error`'s source chain, if a connection was refused.
pub fn refused_in(error: &(dyn std::error::Error + 'static)) -> Option<EgressRefused> {
    let mut at = Some(error);
    while let Some(e) = at {
        if let Some(found) = e.downcast_ref::<EgressRefused>() {
            return Some(found.clone());
        }
        at = e.source();
    }
    None
}

/// The HTTP layer under a bucket source's S3, GCS or Azure client: object_store's client
/// settings on a reqwest client whose names resolve only to admitted addresses, whose
/// redirects and literal addresses are checked, with no proxy, and whose answers are capped as
/// the store's ([`sealed_store::CappedConnector`], whose client cannot take a resolver):
/// a listing page at [`sealed_store::MAX_LISTING_PAGE_BYTES`], an error body at
/// [`MAX_STORE_ERROR_BODY_BYTES`]; an object's bytes are bounded by the size its
/// listing declared (`crate::download::Tap`).
#[derive(Debug)]
pub(crate) struct GuardedConnector {
    pub egress: Arc<Egress>,
    /// Check literal addresses of every request, the endpoint's and the credential
    /// providers' alike. Off only for a source the admin allow-listed for the process's own
    /// credentials, whose provider may be instance metadata (169.254.169.254).
    pub literals: bool,
}

impl std::fmt::Debug for GuardedResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedResolver")
            .field("egress", &self.egress)
            .finish()
    }
}

/// An object store's error body (a short XML or JSON message), as the store caps it.
const MAX_STORE_ERROR_BODY_BYTES: u64 = 1 << 20;

/// Redirects an object-store client follows at most (reqwest's default).
const MAX_STORE_REDIRECTS: usize = 10;

impl HttpConnector for GuardedConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let get = |key| options.get_config_value(&key);
        let duration = |key| -> object_store::Result<Option<std::time::Duration>> {
            get(key)
                .map(|v| {
                    parse_duration(&v).ok_or_else(|| object_store::Error::Generic {
                        store: "source",
                        source: format!("client option {v:?} is not a duration").into(),
                    })
                })
                .transpose()
        };
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("sealed-volumes/", env!("CARGO_PKG_VERSION")))
            .no_proxy()
            .no_gzip()
            .no_brotli()
            .no_zstd()
            .no_deflate()
            .dns_resolver(Arc::new(GuardedResolver::new(self.egress.clone())))
            .redirect(redirect_policy(self.egress.clone(), MAX_STORE_REDIRECTS))
            .https_only(get(ClientConfigKey::AllowHttp).as_deref() != Some("true"));
        if let Some(t) = duration(ClientConfigKey::Timeout)? {
            builder = builder.timeout(t);
        }
        if let Some(t) = duration(ClientConfigKey::ConnectTimeout)? {
            builder = builder.connect_timeout(t);
        }
        let client = builder.build().map_err(|e| object_store::Error::Generic {
            store: "source",
            source: Box::new(e),
        })?;
        Ok(HttpClient::new(GuardedService {
            client,
            egress: self.egress.clone(),
            literals: self.literals,
        }))
    }
}

/// `30s`, `1500ms`, `1m 30s` (object_store's humantime form of what the reader set).
fn parse_duration(v: &str) -> Option<std::time::Duration> {
    let mut total = std::time::Duration::ZERO;
    let mut any = false;
    for part in v.split_whitespace() {
        let (num, unit) = part.split_at(part.find(|c: char| !c.is_ascii_digit())?);
        let n: u64 = num.parse().ok()?;
        let d = match unit {
            "ms" => std::time::Duration::from_millis(n),
            "s" => std::time::Duration::from_secs(n),
            "m" => std::time::Duration::from_secs(n.checked_mul(60)?),
            "h" => std::time::Duration::from_secs(n.checked_mul(3600)?),
            _ => return None,
        };
        total = total.checked_add(d)?;
        any = true;
    }
    any.then_some(total)
}

#[derive(Debug)]
struct GuardedService {
    client: reqwest::Client,
    egress: Arc<Egress>,
    literals: bool,
}

/// A refusal as object_store sees it: `Unknown`, which it does not retry.
fn refused_error(e: EgressRefused) -> HttpError {
    HttpError::new(HttpErrorKind::Unknown, e)
}

impl HttpService for GuardedService {
    // The expansion of `#[async_trait]`, which the trait is declared with.
    fn call<'life0, 'async_trait>(
        &'life0 self,
        req: HttpRequest,
    ) -> Pin<Box<dyn Future<Output = Result<HttpResponse, HttpError>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move {
            if self.literals
                && let Ok(url) = Url::parse(&req.uri().to_string())
            {
                self.egress.check_url(&url).map_err(refused_error)?;
            }
            let method = req.method().clone();
            // The path only, for messages: a query may carry a SAS token.
            let path = req.uri().path().to_owned();
            let listing = req.uri().query().is_some_and(|q| {
                q.split('&')
                    .any(|pair| pair.starts_with("list-type=") || pair == "comp=list")
            });
            let response = match HttpService::call(&self.client, req).await {
                Ok(r) => r,
                Err(e) => return Err(refused_in(&e).map(refused_error).unwrap_or(e)),
            };
            // As the store words them (`sealed_store::CappedConnector`).
            let (what, limit) = if !response.status().is_success() {
                (
                    format!("the error body answering {method} {path}"),
                    MAX_STORE_ERROR_BODY_BYTES,
                )
            } else if method == http::Method::GET && !listing {
                return Ok(response);
            } else if listing {
                (
                    format!("a listing page of {path}"),
                    sealed_store::MAX_LISTING_PAGE_BYTES,
                )
            } else {
                (
                    format!("the body answering {method} {path}"),
                    sealed_store::MAX_LISTING_PAGE_BYTES,
                )
            };
            sealed_store::cap_response(response, what, limit)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn internal_ranges_are_refused_by_default() {
        let e = Egress::default();
        for a in [
            "127.0.0.1",
            "127.255.0.9",
            "0.0.0.0",
            "0.1.2.3",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.255.255",
            "224.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "fe80::1",
            "fd00::1",
            "fc00::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
        ] {
            assert!(e.refusal(ip(a)).is_some(), "{a}");
        }
        for a in [
            "8.8.8.8",
            "1.1.1.1",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
            "64:ff9b::808:808",
        ] {
            assert_eq!(e.refusal(ip(a)), None, "{a}");
        }
    }

    #[test]
    fn admins_allow_and_cluster_ranges_refuse() {
        let e = Egress {
            allowed: Egress::parse_networks(&["127.0.0.0/8".into(), "10.9.9.9".into()], "f")
                .unwrap(),
            cluster: Egress::parse_networks(&["34.118.224.0/20".into()], "f").unwrap(),
        };
        assert_eq!(e.refusal(ip("127.0.0.2")), None);
        assert_eq!(e.refusal(ip("10.9.9.9")), None);
        assert!(e.refusal(ip("10.9.9.10")).is_some());
        assert!(e.refusal(ip("169.254.169.254")).is_some());
        assert!(e.refusal(ip("34.118.230.1")).is_some());
        assert!(Egress::parse_networks(&["not a net".into()], "--x").is_err());
        let err = e
            .check_url(&Url::parse("http://169.254.169.254/latest/meta-data?x=1").unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("169.254.169.254") && err.contains("link-local") && !err.contains("x=1"),
            "{err}"
        );
        assert!(
            e.check_url(&Url::parse("https://[fd00::1]:9000/b").unwrap())
                .is_err()
        );
        assert!(
            e.check_url(&Url::parse("https://example.com/b").unwrap())
                .is_ok()
        );
    }

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("30s"),
            Some(std::time::Duration::from_secs(30))
        );
        assert_eq!(
            parse_duration("1500ms"),
            Some(std::time::Duration::from_millis(1500))
        );
        assert_eq!(
            parse_duration("1m 30s"),
            Some(std::time::Duration::from_secs(90))
        );
        assert_eq!(parse_duration("x"), None);
        assert_eq!(parse_duration("10"), None);
    }
}
