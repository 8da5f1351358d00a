//! Tests of parsing and validation; each names the field an error must point at.

use super::*;
use std::time::Duration;

const MIB: u64 = 1024 * 1024;
const GIB: u64 = 1024 * MIB;

fn base() -> BrokerConfig {
    let mut c = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap();
    c.validate().unwrap();
    c.domains = vec![DomainConfig::new("bmq.test")];
    c
}

fn field_of(c: &BrokerConfig) -> (String, String) {
    let err = c.validate().expect_err("configuration should be invalid");
    (err.field().unwrap().to_string(), err.to_string())
}

#[test]
fn embedded_default_parses_and_validates() {
    // The embedded local-cluster.toml is node 1 of a 3-node cluster with the documented
    // defaults.
    let c = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap();
    c.validate().unwrap();
    assert_eq!(c.node_id, 1);
    assert_eq!(c.members.len(), 3);
    assert_eq!(c.self_member().client_addr(), "127.0.0.1:30101");
    assert_eq!(c.self_member().peer_addr(), "127.0.0.1:30201");
    assert_eq!(c.self_member().admin_addr(), "127.0.0.1:30301");
    assert_eq!(c.peers().map(|m| m.id).collect::<Vec<_>>(), vec![2, 3]);
    let d = c.domain("bmq.test").unwrap();
    assert_eq!(d.consistency, Consistency::Strong);
    assert_eq!(d.mode, DomainMode::Priority);
    assert!(c.domain("nope").is_none());
    // The file documents the defaults: its values equal the built-in ones.
    assert_eq!(c.elector, ElectorSettings::default());
    assert_eq!(c.link, LinkSettings::default());
    assert_eq!(c.metadata, MetadataSettings::default());
    assert_eq!(c.limits, LimitsSettings::default());
    assert_eq!(c.replication, ReplicationSettings::default());
    assert_eq!(c.process, ProcessSettings::default());
    assert_eq!(c.partition_count, 4);
    assert_eq!(*d, DomainConfig::new("bmq.test"));
    assert_eq!(c.effective_quorum(), 2);
}

#[test]
fn minimal_file_gets_defaults() {
    // A file with only the required fields gets every documented default.
    let c = BrokerConfig::from_toml_str(
        r#"
        cluster_name = "c"
        node_id = 1
        data_dir = "/tmp/x"
        members = [{ id = 1, host = "localhost", client_port = 1, peer_port = 2, admin_port = 3 }]
        [[domains]]
        name = "d"
        "#,
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(c.partition_count, 4);
    assert_eq!(c.elector.heartbeat_period(), Duration::from_millis(100));
    assert_eq!(c.elector.leader_loss_timeout(), Duration::from_millis(800));
    assert_eq!(c.elector.initial_wait_ms, 500);
    assert_eq!(c.elector.random_wait_max_ms, 300);
    assert_eq!(c.elector.heartbeat_check_period_ms, 50);
    assert_eq!(c.link.heartbeat_timeout(), Duration::from_secs(1));
    assert_eq!(c.link.reconnect_backoff_min(), Duration::from_millis(50));
    assert_eq!(c.metadata.ledger_max_file_size_bytes, 64 * MIB);
    assert_eq!(c.metadata.fsync, FsyncSetting::EveryRecord);
    assert_eq!(c.limits.frame_size_max_bytes, 64 * MIB);
    assert_eq!(c.limits.max_unconfirmed_bytes_default, 32 * MIB);
    assert_eq!(c.limits.request_timeout(), Duration::from_secs(10));
    assert_eq!(c.limits.mailbox_capacity, 100_000);
    let d = &c.domains[0];
    assert_eq!(d.max_delivery_attempts(), Some(5));
    assert_eq!(d.message_ttl(), None);
    assert_eq!(d.max_queue_messages, 1_000_000);
    assert_eq!(d.max_queue_bytes, GIB);
    assert_eq!(c.log.level, "info");
    assert_eq!(c.log.file, None);
    assert_eq!(c.process.cpu_scheduling, CpuScheduling::Batch);
    assert_eq!(c.effective_quorum(), 1);
    assert_eq!(c.peers().count(), 0);
}

#[test]
fn enums_use_snake_case() {
    // fsync, consistency and mode are written in snake_case.
    let mut c = base();
    c.metadata.fsync = FsyncSetting::Never;
    c.domains[0].consistency = Consistency::Eventual;
    let text = c.to_toml_string();
    assert!(text.contains(r#"fsync = "never""#), "{text}");
    assert!(text.contains(r#"consistency = "eventual""#), "{text}");
    assert!(text.contains(r#"mode = "priority""#), "{text}");
    let back = BrokerConfig::from_toml_str(&text).unwrap();
    assert_eq!(back, c);
    let text = text.replace(r#""never""#, r#""every_record""#);
    let back = BrokerConfig::from_toml_str(&text).unwrap();
    assert_eq!(back.metadata.fsync, FsyncSetting::EveryRecord);
    c.process.cpu_scheduling = CpuScheduling::Normal;
    let text = c.to_toml_string();
    assert!(text.contains(r#"cpu_scheduling = "normal""#), "{text}");
    assert_eq!(BrokerConfig::from_toml_str(&text).unwrap(), c);
    // Any other policy is an error naming the field, not a silent default.
    let text = text.replace(r#""normal""#, r#""fifo""#);
    let err = BrokerConfig::from_toml_str(&text).unwrap_err().to_string();
    assert!(err.contains("cpu_scheduling"), "{err}");
}

#[test]
fn unknown_fields_are_rejected() {
    // A typo, at the top level or in a section, is an error naming the field, not a silent
    // default.
    let text = LOCAL_CLUSTER_TOML.replace("heartbeat_miss_count", "heartbeat_mis_count");
    let err = BrokerConfig::from_toml_str(&text).unwrap_err();
    assert!(matches!(err, ConfigError::Parse { .. }));
    assert!(err.to_string().contains("heartbeat_mis_count"), "{err}");

    let text = format!("colour = \"blue\"\n{LOCAL_CLUSTER_TOML}");
    let err = BrokerConfig::from_toml_str(&text).unwrap_err();
    assert!(err.to_string().contains("colour"), "{err}");

    let text = format!("{LOCAL_CLUSTER_TOML}\n[[domains]]\nname = \"x\"\nmodee = \"priority\"\n");
    let err = BrokerConfig::from_toml_str(&text).unwrap_err();
    assert!(err.to_string().contains("modee"), "{err}");

    let text = LOCAL_CLUSTER_TOML.replace("\"every_record\"", "\"sometimes\"");
    assert_ne!(text, LOCAL_CLUSTER_TOML);
    let err = BrokerConfig::from_toml_str(&text).unwrap_err();
    assert!(err.to_string().contains("sometimes"), "{err}");
}

#[test]
fn invalid_port_names_member_and_port() {
    // A zero port names the member index and the port field.
    let mut c = base();
    c.members[2].peer_port = 0;
    let (field, msg) = field_of(&c);
    assert_eq!(field, "members[2].peer_port");
    assert_eq!(msg, "members[2].peer_port: 0 is not a valid port");
}

#[test]
fn node_id_must_be_a_member() {
    // A node id absent from members lists the members.
    let mut c = base();
    c.node_id = 9;
    let (field, msg) = field_of(&c);
    assert_eq!(field, "node_id");
    assert_eq!(msg, "node_id: 9 is not among members (1, 2, 3)");
}

#[test]
fn duplicate_ids_and_addresses_are_rejected() {
    // Two members with one id, or two listeners on one address, are errors naming the value.
    let mut c = base();
    c.members[2].id = 2;
    assert_eq!(field_of(&c).1, "members: duplicate id 2");

    let mut c = base();
    c.members[2].peer_port = c.members[0].peer_port;
    assert_eq!(field_of(&c).1, "members: duplicate address 127.0.0.1:30201");

    // Same port on one member is a duplicate address too.
    let mut c = base();
    c.members[1].admin_port = c.members[1].client_port;
    assert_eq!(field_of(&c).1, "members: duplicate address 127.0.0.1:30102");
}

#[test]
fn member_count_is_bounded() {
    // Zero members and more than seven are rejected.
    let mut c = base();
    c.members.clear();
    assert_eq!(field_of(&c).0, "members");
    let mut c = base();
    for i in 4..=8 {
        c.members.push(MemberConfig {
            id: i,
            host: "127.0.0.1".into(),
            client_port: 31000 + i as u16,
            peer_port: 32000 + i as u16,
            admin_port: 33000 + i as u16,
            bmqp_port: None,
        });
    }
    let (field, msg) = field_of(&c);
    assert_eq!(field, "members");
    assert!(msg.contains("8 members"), "{msg}");
}

#[test]
fn member_id_and_host_are_checked() {
    // Node id 0 and an empty host are rejected with their field paths.
    let mut c = base();
    c.members[1].id = 0;
    assert_eq!(field_of(&c).0, "members[1].id");
    let mut c = base();
    c.members[0].host = String::new();
    assert_eq!(field_of(&c).0, "members[0].host");
}

#[test]
fn elector_relations_are_checked() {
    // The heartbeat check may not be slower than the heartbeat, and a miss count is needed.
    let mut c = base();
    c.elector.heartbeat_check_period_ms = 200;
    assert_eq!(
        field_of(&c).1,
        "elector.heartbeat_check_period_ms: 200 must not exceed elector.heartbeat_period_ms (100)"
    );
    let mut c = base();
    c.elector.heartbeat_miss_count = 0;
    assert_eq!(
        field_of(&c).1,
        "elector.heartbeat_miss_count: must be at least 1"
    );
    let mut c = base();
    c.elector.heartbeat_period_ms = 0;
    assert_eq!(field_of(&c).0, "elector.heartbeat_period_ms");
    // A quorum above N is allowed (tests use it to forbid leadership).
    let mut c = base();
    c.elector.quorum = 5;
    c.validate().unwrap();
    assert_eq!(c.effective_quorum(), 5);
}

#[test]
fn partition_count_is_bounded() {
    // Zero partitions and more than 1024 are rejected.
    for bad in [0, 1025] {
        let mut c = base();
        c.partition_count = bad;
        let (field, msg) = field_of(&c);
        assert_eq!(field, "partition_count");
        assert!(
            msg.starts_with("partition_count: must be between 1 and 1024"),
            "{msg}"
        );
    }
}

#[test]
fn domains_are_checked() {
    // Empty, malformed and duplicate domain names are rejected with their index.
    let mut c = base();
    c.domains[0].name = String::new();
    let (field, msg) = field_of(&c);
    assert_eq!(field, "domains[0].name");
    assert!(
        msg.starts_with(r#"domains[0].name: "" is not a valid domain name"#),
        "{msg}"
    );

    let mut c = base();
    c.domains[0].name = "a/b".into();
    assert_eq!(field_of(&c).0, "domains[0].name");

    let mut c = base();
    c.domains.push(DomainConfig::new("bmq.test"));
    let (field, msg) = field_of(&c);
    assert_eq!(field, "domains[1].name");
    assert!(msg.contains("duplicate"), "{msg}");

    let mut c = base();
    c.domains[0].max_queue_bytes = 0;
    assert_eq!(field_of(&c).0, "domains[0].max_queue_bytes");
}

#[test]
fn link_metadata_and_limits_are_checked() {
    // Each section's values are range-checked with their field path.
    let mut c = base();
    c.link.heartbeat_timeout_ms = 100;
    assert_eq!(field_of(&c).0, "link.heartbeat_timeout_ms");
    let mut c = base();
    c.link.reconnect_backoff_max_ms = 10;
    assert_eq!(field_of(&c).0, "link.reconnect_backoff_max_ms");
    let mut c = base();
    c.metadata.ledger_max_file_size_bytes = 1000;
    assert_eq!(field_of(&c).0, "metadata.ledger_max_file_size_bytes");
    let mut c = base();
    c.limits.frame_size_max_bytes = 10;
    assert_eq!(field_of(&c).0, "limits.frame_size_max_bytes");
    let mut c = base();
    c.limits.mailbox_capacity = 0;
    assert_eq!(field_of(&c).0, "limits.mailbox_capacity");
    let mut c = base();
    c.log.level = " ".into();
    assert_eq!(field_of(&c).0, "log.level");
}

#[test]
fn load_names_the_file() {
    // Read, parse and validation errors of load() all name the file.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let err = BrokerConfig::load(&missing).unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }));
    assert!(err.to_string().contains("missing.toml"), "{err}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "node_id = [").unwrap();
    let err = BrokerConfig::load(&bad).unwrap_err();
    assert!(matches!(err, ConfigError::Parse { .. }));
    assert!(err.to_string().contains("bad.toml"), "{err}");

    let invalid = dir.path().join("invalid.toml");
    std::fs::write(
        &invalid,
        LOCAL_CLUSTER_TOML.replace("node_id = 1", "node_id = 9"),
    )
    .unwrap();
    let err = BrokerConfig::load(&invalid).unwrap_err();
    assert_eq!(err.field(), Some("node_id"));
    assert!(err.to_string().contains("invalid.toml"), "{err}");
    assert!(
        err.to_string().contains("node_id: 9 is not among members"),
        "{err}"
    );

    let good = dir.path().join("good.toml");
    std::fs::write(&good, LOCAL_CLUSTER_TOML).unwrap();
    assert_eq!(
        BrokerConfig::load(&good).unwrap(),
        BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap()
    );
}

#[test]
fn local_cluster_has_distinct_ports_and_round_trips() {
    // Three local nodes share one member list with distinct ports and their own directories,
    // and each configuration survives a TOML round trip.
    let dir = Path::new("/tmp/bmq-cluster");
    let configs = local_cluster(3, LOCAL_CLUSTER_BASE_PORT, dir).unwrap();
    assert_eq!(configs.len(), 3);
    let mut ports = HashSet::new();
    for m in &configs[0].members {
        assert!(ports.insert(m.client_port));
        assert!(ports.insert(m.peer_port));
        assert!(ports.insert(m.admin_port));
    }
    assert_eq!(ports.len(), 9);
    assert_eq!(configs[1].members[1].client_port, 30102);
    assert_eq!(configs[1].members[1].peer_port, 30202);
    assert_eq!(configs[1].members[1].admin_port, 30302);
    for (i, c) in configs.iter().enumerate() {
        let id = i as u32 + 1;
        assert_eq!(c.node_id, id);
        assert_eq!(c.members, configs[0].members);
        assert_eq!(c.data_dir, dir.join(format!("node-{id}")));
        assert_eq!(
            c.log.file.as_deref(),
            Some(dir.join(format!("node-{id}/broker.log")).as_path())
        );
        let back = BrokerConfig::from_toml_str(&c.to_toml_string()).unwrap();
        assert_eq!(&back, c);
        back.validate().unwrap();
    }
}

#[test]
fn local_cluster_bounds() {
    // Node counts outside 1..=7 and ports past 65535 are rejected; 1 and 7 nodes work.
    let dir = Path::new("/tmp/x");
    assert_eq!(
        local_cluster(0, 30100, dir).unwrap_err().field(),
        Some("nodes")
    );
    assert_eq!(
        local_cluster(8, 30100, dir).unwrap_err().field(),
        Some("nodes")
    );
    assert_eq!(
        local_cluster(3, 65400, dir).unwrap_err().field(),
        Some("base_port")
    );
    assert_eq!(local_cluster(1, 30100, dir).unwrap().len(), 1);
    let seven = local_cluster(7, 40000, dir).unwrap();
    assert_eq!(seven[6].self_member().admin_port, 40207);
}

#[test]
fn ipv6_hosts_are_bracketed() {
    // An IPv6 literal host yields `[host]:port` addresses.
    let m = MemberConfig {
        id: 1,
        host: "::1".into(),
        client_port: 1,
        peer_port: 2,
        admin_port: 3,
        bmqp_port: Some(4),
    };
    assert_eq!(m.client_addr(), "[::1]:1");
    assert_eq!(m.admin_addr(), "[::1]:3");
    assert_eq!(m.bmqp_addr().as_deref(), Some("[::1]:4"));
}

#[test]
fn listen_host_replaces_only_the_bound_host() {
    // Without listen_host a node binds its member addresses; with it, the same ports on the
    // listen host, while the member list (what peers dial) is unchanged.
    let mut c = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap();
    c.members[0].host = "broker1".into();
    assert_eq!(
        c.listen_addrs(),
        ["broker1:30101", "broker1:30201", "broker1:30301"].map(String::from)
    );
    c.listen_host = Some("0.0.0.0".into());
    c.validate().unwrap();
    assert_eq!(
        c.listen_addrs(),
        ["0.0.0.0:30101", "0.0.0.0:30201", "0.0.0.0:30301"].map(String::from)
    );
    assert_eq!(c.self_member().peer_addr(), "broker1:30201");
    let back = BrokerConfig::from_toml_str(&c.to_toml_string()).unwrap();
    assert_eq!(back, c);
    c.listen_host = Some(" ".into());
    assert_eq!(field_of(&c).0, "listen_host");
}

fn settings() -> AuthSettings {
    AuthSettings {
        tokens: vec![
            TokenConfig {
                name: "writer".into(),
                secret: "writer-secret-0123456789".into(),
                domains: vec!["bmq.test".into()],
                permissions: vec![Permission::Produce],
            },
            TokenConfig {
                name: "ops".into(),
                secret: "ops-secret-0123456789abc".into(),
                domains: vec!["*".into()],
                permissions: vec![Permission::Consume, Permission::Admin],
            },
        ],
        bmqp_identity: None,
    }
}

#[test]
fn validation_names_the_field() {
    // Short secrets, duplicate names and unknown domains are configuration errors.
    let domains = vec![DomainConfig::new("bmq.test")];
    let mut s = settings();
    assert!(s.validate(&domains).is_ok());
    s.bmqp_identity = Some("nobody".into());
    assert_eq!(
        s.validate(&domains).unwrap_err().field(),
        Some("auth.bmqp_identity")
    );
    s.bmqp_identity = Some("ops".into());
    assert!(s.validate(&domains).is_ok());
    s.tokens[0].secret = "short".into();
    assert_eq!(
        s.validate(&domains).unwrap_err().field(),
        Some("auth.tokens[0].secret")
    );
    let mut s = settings();
    s.tokens[1].name = "writer".into();
    assert_eq!(
        s.validate(&domains).unwrap_err().field(),
        Some("auth.tokens[1].name")
    );
    let mut s = settings();
    s.tokens[0].domains = vec!["nope".into()];
    assert_eq!(
        s.validate(&domains).unwrap_err().field(),
        Some("auth.tokens[0].domains[0]")
    );
    let a = AdminSettings {
        listen_host: None,
        token: Some("tiny".into()),
    };
    assert_eq!(a.validate().unwrap_err().field(), Some("admin.token"));
}

#[test]
fn the_commented_security_example_parses_and_validates() {
    // The [admin], [tls], [auth] and [[auth.tokens]] example of local-cluster.toml,
    // uncommented, is a valid configuration.
    let text = LOCAL_CLUSTER_TOML;
    let start = text.find("# Security (README").expect("security block");
    let (head, block) = text.split_at(start);
    let mut uncommented = head.to_string();
    for line in block.lines() {
        let l = line.strip_prefix("# ").unwrap_or(line);
        // Only TOML lines: table headers and key = value pairs.
        let is_pair = l.split_once(" = ").is_some_and(|(k, _)| {
            !k.is_empty() && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        });
        if l.starts_with("[admin]")
            || l.starts_with("[tls]")
            || l.starts_with("[auth]")
            || l.starts_with("[[auth")
            || is_pair
        {
            uncommented.push_str(l);
            uncommented.push('\n');
        }
    }
    let c = BrokerConfig::from_toml_str(&uncommented).unwrap();
    c.validate().unwrap();
    assert_eq!(c.auth.bmqp_identity.as_deref(), Some("orders-service"));
    assert_eq!(c.admin.listen_host.as_deref(), Some("0.0.0.0"));
    assert!(c.tls.as_ref().is_some_and(|t| t.client_listener));
    assert_eq!(
        c.auth.tokens[0].permissions,
        vec![Permission::Produce, Permission::Consume]
    );
}

#[test]
fn admin_binds_loopback_unless_told() {
    // A non-loopback member host still gets a loopback admin bind by default.
    let a = AdminSettings::default();
    assert_eq!(a.bind_host("10.1.2.3"), "127.0.0.1");
    assert_eq!(a.bind_host("127.0.0.1"), "127.0.0.1");
    assert_eq!(a.bind_host("::1"), "::1");
    assert_eq!(a.bind_host("localhost"), "localhost");
    let a = AdminSettings {
        listen_host: Some("0.0.0.0".into()),
        token: None,
    };
    assert_eq!(a.bind_host("10.1.2.3"), "0.0.0.0");
}

#[test]
fn join_names_peer_addresses_of_other_nodes() {
    // A joining node lists itself alone and the members it contacts; each entry must be a
    // host:port, and not its own peer address.
    let mut c = base();
    c.members.retain(|m| m.id == c.node_id);
    c.join = vec!["127.0.0.1:30202".into(), "broker3:30203".into()];
    c.validate().unwrap();
    let text = c.to_toml_string();
    assert!(text.contains("join = ["), "{text}");
    assert_eq!(BrokerConfig::from_toml_str(&text).unwrap().join, c.join);
    for (bad, why) in [
        ("127.0.0.1", "not a host:port"),
        ("127.0.0.1:0", "not a host:port"),
        ("bad host:30202", "not a host:port"),
        ("127.0.0.1:30201", "own peer address"),
    ] {
        c.join = vec!["127.0.0.1:30202".into(), bad.into()];
        let (field, message) = field_of(&c);
        assert_eq!(field, "join[1]", "{bad}");
        assert!(message.contains(why), "{bad}: {message}");
    }
}
