// Command etcd is a minimal single-member etcd for tests, embedding
// go.etcd.io/etcd/server/v3 at the version Kubernetes 1.33 pins (v3.5.21).
// etcd's own module carries replace lines, so `go install` of etcd fails;
// embedding it from this module works.
//
//	etcd --data-dir DIR --listen-client-urls http://127.0.0.1:P --listen-peer-urls http://127.0.0.1:Q
package main

import (
	"flag"
	"fmt"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

func mustURL(s string) url.URL {
	u, err := url.Parse(s)
	if err != nil {
		log.Fatalf("bad url %q: %v", s, err)
	}
	return *u
}

func main() {
	dataDir := flag.String("data-dir", "", "data directory (required)")
	client := flag.String("listen-client-urls", "http://127.0.0.1:2379", "client URL")
	peer := flag.String("listen-peer-urls", "http://127.0.0.1:2380", "peer URL")
	quotaBytes := flag.Int64("quota-backend-bytes", 2<<30, "backend size quota")
	logLevel := flag.String("log-level", "warn", "zap log level")
	unsafeNoFsync := flag.Bool("unsafe-no-fsync", true, "skip fsync (test data only)")
	flag.Parse()
	if *dataDir == "" {
		fmt.Fprintln(os.Stderr, "--data-dir is required")
		os.Exit(2)
	}

	cfg := embed.NewConfig()
	cfg.Name = "tailwarden-test"
	cfg.Dir = *dataDir
	cu, pu := mustURL(*client), mustURL(*peer)
	cfg.ListenClientUrls = []url.URL{cu}
	cfg.AdvertiseClientUrls = []url.URL{cu}
	cfg.ListenPeerUrls = []url.URL{pu}
	cfg.AdvertisePeerUrls = []url.URL{pu}
	cfg.InitialCluster = cfg.Name + "=" + pu.String()
	cfg.QuotaBackendBytes = *quotaBytes
	cfg.LogLevel = *logLevel
	cfg.UnsafeNoFsync = *unsafeNoFsync

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("start etcd: %v", err)
	}
	select {
	case <-e.Server.ReadyNotify():
		log.Printf("etcd ready on %s", cu.String())
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		log.Fatal("etcd did not become ready within 60s")
	}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case s := <-sig:
		log.Printf("etcd: %v, stopping", s)
		e.Close()
	case err := <-e.Err():
		log.Fatalf("etcd: %v", err)
	}
}
