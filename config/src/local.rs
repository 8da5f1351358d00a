//! The embedded local default and the configurations of a cluster on this machine.

use std::path::Path;

use crate::{BrokerConfig, ConfigError, MemberConfig, MEMBERS_MAX, MEMBERS_MIN};

/// The commented default configuration (node 1 of a 3-node cluster on 127.0.0.1), embedded at
/// build time from `config/local-cluster.toml`.
pub const LOCAL_CLUSTER_TOML: &str = include_str!("../local-cluster.toml");

/// Default first port of [`local_cluster`]: client ports are 30101.., peer ports 30201..,
/// admin ports 30301...
pub const LOCAL_CLUSTER_BASE_PORT: u16 = 30100;

/// Builds the configurations of an `nodes`-node cluster on 127.0.0.1 from the embedded default
/// ([`LOCAL_CLUSTER_TOML`]).
///
/// Offset of the bmqp (BlazingMQ SDK) ports from the base port: node `i` listens on
/// `base_port + 13 + i`, so node 1 of the default cluster is on 30114, BlazingMQ's default, and
/// an SDK program with no configuration finds it.
pub const BMQP_PORT_OFFSET: usize = 13;

/// Node `i` (1-based) gets id `i`, client port `base_port + i`, bmqp port `base_port + 13 + i`
/// (30114.. by default), peer port `base_port + 100 + i`,
/// admin port `base_port + 200 + i` (with the default base 30100: 30101.., 30201.., 30301..,
/// the ports of the embedded default and of `bmqctl status`), `data_dir` `dir/node-<i>` and log
/// file `dir/node-<i>/broker.log`. Every other setting is the embedded default's.
///
/// Errors: [`ConfigError::Invalid`] with field `nodes` when `nodes` is not in 1..=7, field
/// `base_port` when the ports would pass 65535, or whatever validation finds.
pub fn local_cluster(
    nodes: usize,
    base_port: u16,
    dir: &Path,
) -> Result<Vec<BrokerConfig>, ConfigError> {
    if !(MEMBERS_MIN..=MEMBERS_MAX).contains(&nodes) {
        return Err(ConfigError::invalid(
            "nodes",
            format!("{nodes} is not between {MEMBERS_MIN} and {MEMBERS_MAX}"),
        ));
    }
    let port = |offset: usize, i: usize| -> Result<u16, ConfigError> {
        u16::try_from(usize::from(base_port) + offset + i).map_err(|_| {
            ConfigError::invalid(
                "base_port",
                format!("{base_port} is too high: the ports of {nodes} nodes would pass 65535"),
            )
        })
    };
    let template = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML)?;
    let mut members = Vec::with_capacity(nodes);
    for i in 1..=nodes {
        members.push(MemberConfig {
            id: i as u32,
            host: "127.0.0.1".to_string(),
            client_port: port(0, i)?,
            peer_port: port(100, i)?,
            admin_port: port(200, i)?,
            bmqp_port: Some(port(BMQP_PORT_OFFSET, i)?),
        });
    }
    let mut configs = Vec::with_capacity(nodes);
    for i in 1..=nodes {
        let node_dir = dir.join(format!("node-{i}"));
        let mut config = template.clone();
        config.node_id = i as u32;
        config.members = members.clone();
        config.log.file = Some(node_dir.join("broker.log"));
        config.data_dir = node_dir;
        config.validate()?;
        configs.push(config);
    }
    Ok(configs)
}
