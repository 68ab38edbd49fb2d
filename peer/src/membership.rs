//! Where the ring's members come from. Each source publishes a fresh [`Ring`] on a watch
//! channel whenever its view changes; clients and the server read the latest one per chunk.
//!
//! - [`fixed`]: a list given on the command line (`sealed mount --peers`).
//! - [`from_file`]: a file of addresses re-read every second (a test bed changes it while
//!   nodes read).
//! - [`from_endpoint_slices`]: the node plugins' headless Service in Kubernetes: every ready
//!   endpoint of its EndpointSlices, at the peer port.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::PeerError;
use crate::ring::{Ring, RingView};

/// Most members a source accepts: beyond this the input is wrong, not a fleet.
pub const MAX_MEMBERS: usize = 100_000;

/// A membership whose source runs in `task` (none for a fixed list); dropping it stops it.
pub struct Membership {
    pub view: RingView,
    task: Option<JoinHandle<()>>,
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Parses `host:port,host:port,…` (whitespace and newlines also separate).
pub fn parse_addrs(text: &str) -> Result<Vec<String>, PeerError> {
    let addrs: Vec<String> = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    if addrs.len() > MAX_MEMBERS {
        return Err(PeerError::Membership(format!(
            "{} peers listed; at most {MAX_MEMBERS}",
            addrs.len()
        )));
    }
    for a in &addrs {
        check_addr(a)?;
    }
    Ok(addrs)
}

/// A peer address is `host:port` with a non-zero port and no scheme or path.
pub fn check_addr(addr: &str) -> Result<(), PeerError> {
    let bad = || {
        PeerError::Membership(format!(
            "peer address {addr:?} is not host:port (e.g. 10.0.0.7:7070)"
        ))
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-[]:".contains(&b));
    if port == 0 || !host_ok {
        return Err(bad());
    }
    Ok(())
}

/// A fixed list of members.
pub fn fixed(addrs: Vec<String>, fanout: usize) -> Membership {
    let (tx, view) = watch::channel(Arc::new(Ring::new(addrs, fanout)));
    // Keep the sender alive with the receiver: a closed channel still reads, but be plain.
    let task = tokio::spawn(async move {
        tx.closed().await;
    });
    Membership {
        view,
        task: Some(task),
    }
}

/// The members listed in `path`, re-read every `every`. A file that cannot be read or parsed
/// keeps the last good view (and says why, once per change of reason).
pub fn from_file(path: PathBuf, fanout: usize, every: Duration) -> Result<Membership, PeerError> {
    let read = |path: &PathBuf| -> Result<Vec<String>, PeerError> {
        let meta = std::fs::metadata(path)
            .map_err(|e| PeerError::Membership(format!("cannot read {}: {e}", path.display())))?;
        if meta.len() > 16 << 20 {
            return Err(PeerError::Membership(format!(
                "{} is larger than 16 MiB",
                path.display()
            )));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| PeerError::Membership(format!("cannot read {}: {e}", path.display())))?;
        parse_addrs(&text)
    };
    let first = read(&path)?;
    let (tx, view) = watch::channel(Arc::new(Ring::new(first, fanout)));
    let task = tokio::spawn(async move {
        let mut last_error = None;
        loop {
            tokio::time::sleep(every).await;
            match read(&path) {
                Ok(addrs) => {
                    last_error = None;
                    publish(&tx, Ring::new(addrs, fanout));
                }
                Err(e) => {
                    let reason = e.to_string();
                    if last_error.as_ref() != Some(&reason) {
                        tracing::warn!(error = %reason, "keeping the last peer list");
                        last_error = Some(reason);
                    }
                }
            }
        }
    });
    Ok(Membership {
        view,
        task: Some(task),
    })
}

/// The ready endpoints of Service `service`'s EndpointSlices in `namespace`, each at `port`.
/// Starts empty (every chunk from the origin) until the first list arrives; a watch that
/// breaks is restarted with backoff, keeping the last view meanwhile.
pub fn from_endpoint_slices(
    client: Client,
    namespace: &str,
    service: &str,
    port: u16,
    fanout: usize,
) -> Membership {
    let (tx, view) = watch::channel(Arc::new(Ring::new(Vec::<String>::new(), fanout)));
    let api: Api<EndpointSlice> = Api::namespaced(client, namespace);
    let config =
        watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
    let service = service.to_owned();
    let task = tokio::spawn(async move {
        use watcher::Event;
        let mut slices: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut pending: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut events = std::pin::pin!(watcher(api, config).default_backoff());
        while let Some(event) = events.next().await {
            match event {
                Ok(Event::Init) => pending.clear(),
                Ok(Event::InitApply(slice)) => {
                    pending.insert(slice_name(&slice), ready_addrs(&slice, port));
                }
                Ok(Event::InitDone) => slices = std::mem::take(&mut pending),
                Ok(Event::Apply(slice)) => {
                    slices.insert(slice_name(&slice), ready_addrs(&slice, port));
                }
                Ok(Event::Delete(slice)) => {
                    slices.remove(&slice_name(&slice));
                }
                Err(e) => {
                    tracing::warn!(%service, error = %e, "watching the peers' EndpointSlices");
                    continue;
                }
            }
            let members: BTreeSet<&String> = slices.values().flatten().collect();
            if members.len() > MAX_MEMBERS {
                tracing::warn!(%service, n = members.len(), "too many peers; keeping the last view");
                continue;
            }
            publish(&tx, Ring::new(members.into_iter().cloned(), fanout));
        }
    });
    Membership {
        view,
        task: Some(task),
    }
}

fn slice_name(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

/// `addr:port` of every endpoint not marked unready (Kubernetes: a missing `ready` means
/// ready) and not terminating.
fn ready_addrs(slice: &EndpointSlice, port: u16) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
        return out;
    }
    for endpoint in &slice.endpoints {
        let conditions = endpoint.conditions.as_ref();
        let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
        let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
        if !ready || terminating {
            continue;
        }
        for ip in &endpoint.addresses {
            let Ok(ip) = ip.parse::<std::net::IpAddr>() else {
                continue;
            };
            out.insert(std::net::SocketAddr::new(ip, port).to_string());
        }
    }
    out
}

fn publish(tx: &watch::Sender<Arc<Ring>>, ring: Ring) {
    tx.send_if_modified(|current| {
        if **current == ring {
            return false;
        }
        tracing::info!(members = ring.len(), "peer membership changed");
        *current = Arc::new(ring);
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked() {
        assert_eq!(
            parse_addrs("10.0.0.1:7070, node-b:7070\n[::1]:7070").unwrap(),
            ["10.0.0.1:7070", "node-b:7070", "[::1]:7070"]
        );
        for bad in ["10.0.0.1", "http://x:1", "x:0", "x:99999", ":80", "a/b:1"] {
            assert!(parse_addrs(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn only_ready_endpoints_count() {
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "s"},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
                {"addresses": ["10.0.0.2"]},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": false}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": true, "terminating": true}},
                {"addresses": ["not-an-ip"]},
            ],
        }))
        .unwrap();
        let got: Vec<String> = ready_addrs(&slice, 7070).into_iter().collect();
        assert_eq!(got, ["10.0.0.1:7070", "10.0.0.2:7070"]);
    }
}
