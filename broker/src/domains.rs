//! The node's view of the domains (DESIGN.md §5a): the committed domain state once a leader
//! seeded it, this node's `[[domains]]` before that. [`DomainCache`] holds it as the
//! data-plane cores use it ([`DomainPolicies`]); the commit fan-out replaces it on every
//! commit that changed the domains, and the router then tells every partition.
//!
//! Readers: a client session's open (is the domain known?), the partitions (their queues'
//! policies, through [`crate::actors::partition::SetPartitionDomains`]), the journal's index
//! (which app ids a queue's messages are stored for, [`DomainCache::apps_of`]).

use std::sync::{Arc, RwLock};

use bmq_config::{BrokerConfig, Consistency, DomainConfig, DomainMode};
use bmq_dataplane::{AppsOf, DeliveryMode, DomainPolicies, DomainPolicy, QueueLimits};
use bmq_metadata::{ClusterState, DomainState};
use tracing::warn;

/// The domains this node resolves queues against (see the module doc).
#[derive(Debug)]
pub struct DomainCache {
    /// The policies now, and the committed state they were built from (`None`: the file's).
    current: RwLock<(Arc<DomainPolicies>, Option<Arc<DomainState>>)>,
    /// This node's `[[domains]]`: the seed, and what a disagreement is measured against.
    file: Vec<DomainConfig>,
}

impl DomainCache {
    /// The cache of a node starting with `state` (its ledger's committed state).
    pub fn new(config: &BrokerConfig, state: &ClusterState) -> Arc<DomainCache> {
        let cache = DomainCache {
            current: RwLock::new((Arc::new(policies_of(config.domains.iter())), None)),
            file: config.domains.clone(),
        };
        cache.update(state);
        Arc::new(cache)
    }

    /// The policies now.
    pub fn policies(&self) -> Arc<DomainPolicies> {
        self.current.read().expect("domains lock").0.clone()
    }

    /// Whether domain `name` exists.
    pub fn has_domain(&self, name: &str) -> bool {
        self.current
            .read()
            .expect("domains lock")
            .0
            .domain(name)
            .is_some()
    }

    /// Takes the domains of a committed `state`; returns the new policies if they changed.
    /// A state without domains (not seeded yet) leaves the file's.
    pub fn update(&self, state: &ClusterState) -> Option<Arc<DomainPolicies>> {
        let committed = state.domains.as_ref()?;
        let mut current = self.current.write().expect("domains lock");
        if current
            .1
            .as_ref()
            .is_some_and(|d| Arc::ptr_eq(d, committed))
        {
            return None;
        }
        let first = current.1.is_none();
        let policies = Arc::new(policies_of(committed.domains.values().map(|d| &d.config)));
        *current = (policies.clone(), Some(committed.clone()));
        drop(current);
        if first {
            if let Some(difference) = committed.file_differences(&self.file) {
                warn!(%difference, version = %committed.version, "the configured [[domains]] differ from the committed domains; the committed domains apply");
            }
        }
        Some(policies)
    }

    /// How this node's `[[domains]]` differ from the committed domains, if they do.
    pub fn file_disagreement(&self, state: &ClusterState) -> Option<String> {
        state.domains.as_ref()?.file_differences(&self.file)
    }

    /// For the journal's index: the app ids a queue's messages are stored for, as the domains
    /// say when its first message is written (see [`DomainPolicies::apps_of`]).
    pub fn apps_of(self: &Arc<Self>) -> AppsOf {
        let cache = self.clone();
        Arc::new(move |uri: &str| {
            cache
                .policies()
                .resolve(uri)
                .map_or_else(|| vec![String::new()], DomainPolicy::apps)
        })
    }
}

/// Domains' settings as the data-plane cores use them.
pub fn policies_of<'a>(domains: impl Iterator<Item = &'a DomainConfig>) -> DomainPolicies {
    DomainPolicies::new(domains.map(|d| {
        let mode = match d.mode {
            DomainMode::Priority => DeliveryMode::Priority,
            DomainMode::Broadcast => DeliveryMode::Broadcast,
            DomainMode::Fanout => DeliveryMode::Fanout {
                app_ids: d.app_ids.clone(),
            },
        };
        let policy = DomainPolicy {
            mode,
            strong: d.consistency == Consistency::Strong,
            limits: QueueLimits {
                max_messages: d.max_queue_messages,
                max_bytes: d.max_queue_bytes,
                max_delivery_attempts: d.max_delivery_attempts,
                message_ttl: d.message_ttl(),
            },
        };
        (d.name.clone(), policy)
    }))
}
