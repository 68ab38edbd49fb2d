//! The node plugin's part of the peer tier (`sealed-peer`, docs/peer.md): its flags, its
//! membership (the EndpointSlices of the plugins' headless Service, or a fixed list), and
//! its Prometheus series. The store's credentials stay in this process; peers get verified
//! chunk bytes only.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts};
use sealed_mount::{MountMetrics, NodeCache};
use sealed_peer::{
    Membership, PeerMetrics, PeerNode, PeerOptions, PeerToken, RingView, membership,
};
use sealed_store::ChunkStore;

/// `--peer-*` flags, resolved.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    pub listen: SocketAddr,
    /// This node as the others list it: `<pod IP>:<port>` (the chart passes the pod IP).
    pub advertise: String,
    /// The token file and the TLS files, re-read while the plugin runs (rotation).
    pub files: sealed_peer::PeerFiles,
    pub members: PeerMembers,
    pub request_timeout: Duration,
    pub fanout: usize,
    /// Cap on the bytes per second sent to all peers together; `None`: none.
    pub upload_rate: Option<u64>,
    /// TLS between peers; `None`: h2c.
    pub tls: Option<sealed_peer::PeerTls>,
    /// The peer port's connection bounds.
    pub limits: sealed_peer::ConnLimits,
}

#[derive(Clone, Debug)]
pub enum PeerMembers {
    /// `host:port` of every node.
    Fixed(Vec<String>),
    /// The ready endpoints of this headless Service's EndpointSlices, at `port`.
    Service {
        namespace: String,
        name: String,
        port: u16,
    },
}

/// Serves this node's cache to its peers and installs the tier in `cache`.
pub async fn start(
    config: &PeerConfig,
    cache: &NodeCache,
    store: ChunkStore,
) -> anyhow::Result<PeerNode> {
    let token = PeerToken::from_file(&config.files.token)?;
    membership::check_addr(&config.advertise).context("--peer-advertise")?;
    let mut options = PeerOptions::new(config.listen, config.advertise.clone(), token);
    options.set_request_timeout(config.request_timeout);
    options.fanout = config.fanout.max(1);
    options.upload_rate = config.upload_rate;
    options.tls = config.tls.clone();
    options.limits = config.limits.clone();
    options.files = Some(config.files.clone());
    let members: Membership = match &config.members {
        PeerMembers::Fixed(addrs) => membership::fixed(addrs.clone(), options.fanout),
        PeerMembers::Service {
            namespace,
            name,
            port,
        } => {
            let client = kube::Client::try_default()
                .await
                .context("the peer tier's membership needs the API server")?;
            membership::from_endpoint_slices(client, namespace, name, *port, options.fanout)
        }
    };
    Ok(PeerNode::start(&options, members, cache, store).await?)
}

/// The peer series, read at scrape time: bytes by tier (`sealed_tier_bytes_total`, for the
/// peer and origin tiers), the mount's peer counters, and the tier's own (owner load).
pub struct PeerCollector {
    mount: Arc<MountMetrics>,
    peer: Arc<PeerMetrics>,
    ring: RingView,
    descs: Vec<Desc>,
}

impl PeerCollector {
    pub fn new(mount: Arc<MountMetrics>, node: &PeerNode) -> Result<Self, prometheus::Error> {
        let mut this = PeerCollector {
            mount,
            peer: node.metrics.clone(),
            ring: node.ring.clone(),
            descs: Vec::new(),
        };
        this.descs = this
            .families()
            .iter()
            .flat_map(|f| f.desc().into_iter().cloned().collect::<Vec<_>>())
            .collect();
        Ok(this)
    }

    fn families(&self) -> Vec<Box<dyn Collector>> {
        let m = self.mount.snapshot();
        let p = self.peer.snapshot();
        let mut out: Vec<Box<dyn Collector>> = Vec::new();
        let bytes = IntCounterVec::new(
            Opts::new(
                "sealed_tier_bytes_total",
                "Chunk bytes fetched into this node by tier (peer, origin)",
            ),
            &["tier"],
        )
        .expect("static metric");
        bytes
            .with_label_values(&["peer"])
            .inc_by(m.peer_bytes_fetched);
        bytes
            .with_label_values(&["origin"])
            .inc_by(m.store_bytes_fetched);
        out.push(Box::new(bytes));
        let counters: [(&str, &str, u64); 23] = [
            (
                "sealed_peer_hits_total",
                "Chunks a peer served (verified)",
                m.peer_hits,
            ),
            (
                "sealed_peer_fallbacks_total",
                "Chunks the peer tier did not answer (fetched from the origin), including those this node owns",
                m.peer_fallbacks,
            ),
            (
                "sealed_peer_corrupt_total",
                "Chunks a peer served wrong (refetched from the origin, never served)",
                m.peer_corrupt,
            ),
            (
                "sealed_peer_requests_total",
                "Requests this node sent to owners",
                p.requests,
            ),
            (
                "sealed_peer_request_failures_total",
                "Requests to owners that failed or were refused",
                p.request_failures,
            ),
            (
                "sealed_peer_request_busy_total",
                "Requests to owners answered 503 (too many at once there)",
                p.request_busy,
            ),
            (
                "sealed_peer_request_timeouts_total",
                "Requests to owners that sent no headers within --peer-timeout-ms (owner marked down)",
                p.request_timeouts,
            ),
            (
                "sealed_peer_body_timeouts_total",
                "Requests to owners that answered but sent no chunk within the body bound",
                p.body_timeouts,
            ),
            (
                "sealed_peer_skipped_down_total",
                "Chunks whose best owner was marked down (asked of the next-best member, or fetched here)",
                p.skipped_down,
            ),
            (
                "sealed_peer_rerouted_total",
                "Chunks asked of the next-best member because their owner was marked down",
                p.rerouted,
            ),
            (
                "sealed_peer_slow_headers_total",
                "Requests whose headers were late from an owner still sending (busy: waited for, not marked down)",
                p.slow_headers,
            ),
            (
                "sealed_peer_owned_here_total",
                "Chunks this node owns, fetched from the origin here",
                p.owned_here,
            ),
            (
                "sealed_peer_served_requests_total",
                "Owner load: chunk requests this node answered",
                p.served_requests,
            ),
            (
                "sealed_peer_served_bytes_total",
                "Owner load: chunk bytes this node sent to peers",
                p.served_bytes,
            ),
            (
                "sealed_peer_served_rejected_total",
                "Peer requests turned away (token, malformed)",
                p.served_rejected,
            ),
            (
                "sealed_peer_served_busy_total",
                "Peer requests told 503: too many at once here",
                p.served_busy,
            ),
            (
                "sealed_peer_served_errors_total",
                "Peer requests this node could not answer (origin error, timeout)",
                p.served_errors,
            ),
            (
                "sealed_peer_forwarded_total",
                "Requests this node (a secondary owner) passed on to the primary",
                p.forwarded,
            ),
            (
                "sealed_peer_tls_refused_total",
                "Connections to the TLS peer port whose handshake failed or stalled",
                p.tls_refused,
            ),
            (
                "sealed_peer_upload_wait_microseconds_total",
                "Microseconds answers to peers waited for the upload cap (--peer-upload-rate), summed",
                p.upload_wait_us,
            ),
            (
                "sealed_peer_fetched_bytes_total",
                "Chunk bytes peers served this node (verified)",
                m.peer_bytes_fetched,
            ),
            (
                "sealed_peer_stalls_total",
                "Owner answers whose body stalled (below the rate floor, or no body): the owner was marked down",
                p.stalls,
            ),
            (
                "sealed_peer_revived_total",
                "Owners this node could not reach (marked down) that answered a probe before their 5 s were up, and were asked again from then on",
                p.revived,
            ),
        ];
        for (name, help, value) in counters {
            let c = IntCounter::new(name, help).expect("static metric");
            c.inc_by(value);
            out.push(Box::new(c));
        }
        // By owner: at most sealed_peer::metrics::MAX_OWNERS_COUNTED addresses, then "other".
        let by_owner = IntCounterVec::new(
            Opts::new(
                "sealed_peer_owner_stalls_total",
                "Stalled answers by owner address (bounded: the rest under owner=\"other\")",
            ),
            &["owner"],
        )
        .expect("static metric");
        for (owner, n) in self.peer.owner_stalls() {
            by_owner.with_label_values(&[owner.as_str()]).inc_by(n);
        }
        out.push(Box::new(by_owner));
        let members = IntGauge::new(
            "sealed_peer_members",
            "Members in this node's view of the fleet",
        )
        .expect("static metric");
        members.set(i64::try_from(self.ring.borrow().len()).unwrap_or(i64::MAX));
        out.push(Box::new(members));
        out
    }
}

impl Collector for PeerCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.families().iter().flat_map(|c| c.collect()).collect()
    }
}
