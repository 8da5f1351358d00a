//! Generates the prost types from `proto/*.proto` with `protox`, so no system `protoc` is needed.

fn main() {
    let files = ["proto/peer.proto", "proto/client.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"]).expect("proto files must compile");
    prost_build::Config::new()
        .bytes(["."])
        // A domain change carries two domains' settings, a snapshot every domain: boxed, so
        // every other advisory (and every metadata message) stays about as small as before.
        .boxed(".bmq.peer.Advisory.kind.domain")
        .boxed(".bmq.peer.ClusterStateSnapshot.domains")
        .compile_fds(fds)
        .expect("prost code generation must succeed");
}
