package fastpull

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/docker/docker/api/types/system"
)

// dockerInsecure says whether Docker takes registry host (host[:port]) as
// insecure (http, or https without checking the certificate), by Docker's
// rule: its insecure-registries by name, else any address the host
// resolves to inside an insecure CIDR (127.0.0.0/8 by default).
func dockerInsecure(ctx context.Context, info system.Info, host string) bool {
	rc := info.RegistryConfig
	if rc == nil {
		return false
	}
	if ic, ok := rc.IndexConfigs[host]; ok && ic != nil {
		return !ic.Secure
	}
	hostname := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		hostname = h
	}
	var ips []net.IP
	if ip := net.ParseIP(hostname); ip != nil {
		ips = []net.IP{ip}
	} else {
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		addrs, err := net.DefaultResolver.LookupIP(lctx, "ip", hostname)
		if err != nil {
			return false // Docker: a name that does not resolve is secure
		}
		ips = addrs
	}
	for _, ip := range ips {
		for _, n := range rc.InsecureRegistryCIDRs {
			if n != nil && (*net.IPNet)(n).Contains(ip) {
				return true
			}
		}
	}
	return false
}

// loopback says whether registry host (host[:port]) is on this machine:
// every address it resolves to is a loopback one.
func loopback(ctx context.Context, host string) bool {
	hostname := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		hostname = h
	}
	if ip := net.ParseIP(hostname); ip != nil {
		return ip.IsLoopback()
	}
	lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupIP(lctx, "ip", hostname)
	if err != nil || len(addrs) == 0 {
		return false
	}
	for _, ip := range addrs {
		if !ip.IsLoopback() {
			return false
		}
	}
	return true
}

// baseTransport is the HTTP transport of one pull: no proxy (a Docker
// with one is left to Docker's pull), HTTP/1.1 only (HTTP/2 would put
// every range on one connection, which is what a capped link punishes),
// Docker's TLS trust for the registry (certs.d), and bounded waits.
func baseTransport(certsDir, host string, insecure bool, conns int) (*http.Transport, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if insecure {
		tc.InsecureSkipVerify = true //nolint:gosec // Docker's insecure-registries: the user's choice
	} else if err := dockerCerts(tc, filepath.Join(certsDir, host)); err != nil {
		return nil, err
	}
	return &http.Transport{
		DialContext:           (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:       tc,
		TLSHandshakeTimeout:   15 * time.Second,
		ResponseHeaderTimeout: 60 * time.Second,
		MaxIdleConnsPerHost:   conns,
		IdleConnTimeout:       30 * time.Second,
		TLSNextProto:          map[string]func(string, *tls.Conn) http.RoundTripper{},
	}, nil
}

// dockerCerts adds what Docker reads from /etc/docker/certs.d/<host>: CA
// files (*.crt) beside the system's, and client pairs (x.cert, x.key).
func dockerCerts(tc *tls.Config, dir string) error {
	entries, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", dir, err)
	}
	for _, e := range entries {
		name := e.Name()
		path := filepath.Join(dir, name)
		switch {
		case strings.HasSuffix(name, ".crt"):
			if tc.RootCAs == nil {
				pool, err := x509.SystemCertPool()
				if err != nil {
					pool = x509.NewCertPool()
				}
				tc.RootCAs = pool
			}
			pem, err := readSmall(path)
			if err != nil {
				return err
			}
			if !tc.RootCAs.AppendCertsFromPEM(pem) {
				return fmt.Errorf("%s: no certificate", path)
			}
		case strings.HasSuffix(name, ".cert"):
			key := strings.TrimSuffix(path, ".cert") + ".key"
			pair, err := tls.LoadX509KeyPair(path, key)
			if err != nil {
				return fmt.Errorf("client certificate %s: %w", path, err)
			}
			tc.Certificates = append(tc.Certificates, pair)
		}
	}
	return nil
}

func readSmall(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 1<<20+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(b) > 1<<20 {
		return nil, fmt.Errorf("%s: over 1 MiB", path)
	}
	return b, nil
}
