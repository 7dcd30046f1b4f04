package testenv

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The cold registry: Debian's docker-registry (the distribution registry)
// as a pull from far away sees it. It listens on a unix socket; in front of
// it, inside a network namespace of its own (NewNetns), a TLS front in Go
// (HTTP/1.1: one TCP connection per request in flight, as Docker and a
// CDN's edge use them) with a test CA that Docker trusts through
// /etc/docker/certs.d, optional faults, and byte counters. What the
// namespace sends back to the host is shaped per connection and in total
// (ShapeEgress). Auth is none, htpasswd, or bearer tokens from a token
// server of the test's (docker-registry's auth: token:, JWTs signed with a
// test key whose certificate the registry's rootcertbundle trusts).

// AuthKind is how the cold registry asks for credentials.
type AuthKind int

const (
	AuthNone  AuthKind = iota // anyone pulls and pushes
	AuthBasic                 // htpasswd: Basic on every request
	AuthToken                 // 401 with a Bearer challenge; the token server takes Basic credentials
)

func (a AuthKind) String() string {
	return [...]string{"none", "basic", "token"}[a]
}

// ColdOptions configures StartColdRegistry. The zero value is a token-less,
// auth-less registry on the default link: 100 Mbit/s per connection,
// 1 Gbit/s in total.
type ColdOptions struct {
	Auth AuthKind
	// PerConnMbit and TotalMbit: 0 is the default (100, 1000); below 0 no
	// cap of that kind. Uncapped turns both off.
	PerConnMbit, TotalMbit int
	Uncapped               bool
	// Faults are the front's faults from the start (SetFaults changes
	// them at any time: push first, then break).
	Faults Faults
}

// Faults are what the TLS front does wrong to blob GETs (/v2/.../blobs/...).
// They compose: a refused Range and a stall apply together.
type Faults struct {
	// RefuseRange drops the request's Range (and If-Range): the whole blob
	// comes back, 200, without Accept-Ranges, as from a server that
	// ignores ranges.
	RefuseRange bool
	// StallAfter, above 0: the body stops after this many bytes of the
	// answer and the connection stays open, sending nothing, until the
	// client goes or the test ends.
	StallAfter int64
	// Corrupt flips the byte at blob offset CorruptAt (of the whole blob:
	// a ranged answer covering it has it flipped too).
	Corrupt   bool
	CorruptAt int64
	// OnlyRanged: the faults apply only to requests that carry a Range
	// (Docker's own pull asks for none, so it still succeeds: a fallback).
	OnlyRanged bool
	// Digests: only blobs of these digests ("sha256:..."); none is every
	// blob.
	Digests []string
	// Times: only the first Times requests that match (0 is all of them).
	Times int
}

// ColdStats counts what the front served since the registry started (or
// ResetStats).
type ColdStats struct {
	Conns         int64 // TCP connections accepted
	Requests      int64
	BlobGets      int64
	RangedGets    int64 // blob GETs with a Range header
	Faulted       int64 // blob GETs a fault applied to
	BlobBytes     int64 // blob body bytes sent
	LastBlobByte  time.Time
	TokenRequests int64
}

// ColdRegistry is a started cold registry.
type ColdRegistry struct {
	Host               string // NsIP:5000, what image references name
	Username, Password string // "" for AuthNone
	Auth               AuthKind
	CAPEM              []byte         // the test CA, also at /etc/docker/certs.d/<Host>/ca.crt
	Roots              *x509.CertPool // the CA, for a Go client
	Netns              *Netns
	Root               string // the registry's storage root directory
	dir                string
	front              *coldFront
}

const coldRegistryPort = 5000
const coldTokenPort = 5001

// StartColdRegistry starts it all; everything goes when the test ends: the
// registry's process group, the front and token server, the namespace with
// its veths and nft table, the certs.d directories, and the images the
// machine's engine pulled from it.
func StartColdRegistry(t testing.TB, o ColdOptions) *ColdRegistry {
	t.Helper()
	RequireDocker(t)
	for _, tool := range []string{"docker-registry", "ip", "tc", "nft", "htpasswd"} {
		if _, err := exec.LookPath(tool); err != nil {
			msg := fmt.Sprintf("%s not found (make deps installs it)", tool)
			if InCI() {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
	}
	ns := NewNetns(t)
	dir := t.TempDir()
	r := &ColdRegistry{Host: net.JoinHostPort(ns.NsIP.String(), strconv.Itoa(coldRegistryPort)), Auth: o.Auth, Netns: ns, Root: filepath.Join(dir, "data"), dir: dir}
	RemoveImagesFrom(t, r.Host)
	if !o.Uncapped {
		per, total := o.PerConnMbit, o.TotalMbit
		if per == 0 {
			per = 100
		}
		if total == 0 {
			total = 1000
		}
		ns.ShapeEgress(t, Shape{PerConnMbit: per, TotalMbit: total})
	}
	pki := newTestPKI(t, ns.NsIP)
	r.CAPEM, r.Roots = pki.caPEM, pki.roots
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), pki.caPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	// Docker reads certs.d at each pull: no restart. The token server's
	// port gets the CA too (a client may look it up by the realm's host).
	for _, port := range []int{coldRegistryPort, coldTokenPort} {
		d := filepath.Join("/etc/docker/certs.d", net.JoinHostPort(ns.NsIP.String(), strconv.Itoa(port)))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.RemoveAll(d) })
		if err := os.WriteFile(filepath.Join(d, "ca.crt"), pki.caPEM, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	authCfg := ""
	switch o.Auth {
	case AuthBasic, AuthToken:
		r.Username, r.Password = "tandem", "cold-"+randomHex(6)
	}
	switch o.Auth {
	case AuthBasic:
		out, err := exec.Command("htpasswd", "-Bbn", r.Username, r.Password).Output()
		if err != nil {
			t.Fatalf("htpasswd: %v", err)
		}
		if err := os.WriteFile(filepath.Join(dir, "htpasswd"), out, 0o600); err != nil {
			t.Fatal(err)
		}
		authCfg = fmt.Sprintf("auth:\n  htpasswd:\n    realm: tandem-cold\n    path: %s/htpasswd\n", dir)
	case AuthToken:
		ts := &tokenServer{user: r.Username, pass: r.Password, service: "tandem-cold", issuer: "tandem-test-issuer", key: pki.tokenKey, certDER: pki.tokenCert}
		ln, err := ns.Listen("tcp", net.JoinHostPort(ns.NsIP.String(), strconv.Itoa(coldTokenPort)))
		if err != nil {
			t.Fatalf("token server listen: %v", err)
		}
		srv := &http.Server{Handler: ts, TLSConfig: &tls.Config{Certificates: []tls.Certificate{pki.server}, NextProtos: []string{"http/1.1"}}, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = srv.Serve(tls.NewListener(ln, srv.TLSConfig)) }()
		t.Cleanup(func() { _ = srv.Close() })
		authCfg = fmt.Sprintf("auth:\n  token:\n    realm: https://%s/token\n    service: %s\n    issuer: %s\n    rootcertbundle: %s/ca.crt\n",
			net.JoinHostPort(ns.NsIP.String(), strconv.Itoa(coldTokenPort)), ts.service, ts.issuer, dir)
		r.front = &coldFront{tokens: &ts.requests}
	}

	sock := filepath.Join(dir, "registry.sock")
	cfg := fmt.Sprintf(`version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  net: unix
  addr: %s
  relativeurls: true
%s`, r.Root, sock, authCfg)
	if err := os.WriteFile(filepath.Join(dir, "config.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := ns.Command("docker-registry", "serve", filepath.Join(dir, "config.yml"))
	logf, err := os.Create(filepath.Join(dir, "registry.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	t.Cleanup(func() { logf.Close() })
	StartDaemon(t, cmd)

	if r.front == nil {
		r.front = &coldFront{}
	}
	r.front.start(t, ns, r.Host, sock, pki.server)
	r.front.set(o.Faults)

	// Up when /v2/ answers through the front: 200, or 401 with auth.
	c := r.Client()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := c.Get("https://" + r.Host + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
				break
			}
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "registry.log"))
			t.Fatalf("cold registry did not come up: %v\n%s", err, b)
		}
		time.Sleep(100 * time.Millisecond)
	}
	r.front.reset()
	return r
}

// Ref is the image reference of repo (name:tag) in this registry.
func (r *ColdRegistry) Ref(repo string) string { return r.Host + "/" + repo }

// SetFaults replaces the front's faults (and restarts their Times count).
func (r *ColdRegistry) SetFaults(f Faults) { r.front.set(f) }

// Stats is what the front served so far.
func (r *ColdRegistry) Stats() ColdStats { return r.front.stats() }

// ResetStats zeroes the counters.
func (r *ColdRegistry) ResetStats() { r.front.reset() }

// LinkBytesPerSecond is the link's total cap, 0 when uncapped.
func (r *ColdRegistry) LinkBytesPerSecond() float64 { return r.Netns.LinkBytesPerSecond() }

// Client is an HTTP client that trusts the test CA (HTTP/1.1, as the front
// speaks).
func (r *ColdRegistry) Client() *http.Client {
	return &http.Client{Transport: &http.Transport{
		TLSClientConfig:     &tls.Config{RootCAs: r.Roots},
		MaxIdleConnsPerHost: 64,
		ForceAttemptHTTP2:   false,
	}}
}

// DockerConfig is a private docker CLI config directory logged in to the
// registry (none needed for AuthNone: an empty one): pass it as
// `docker --config DIR`.
func (r *ColdRegistry) DockerConfig(t testing.TB) string {
	t.Helper()
	cfgDir := t.TempDir()
	if r.Auth == AuthNone {
		return cfgDir
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := Docker(ctx, "--config", cfgDir, "login", "-u", r.Username, "-p", r.Password, r.Host); err != nil {
		t.Fatal(err)
	}
	return cfgDir
}

// Push pushes the local image through the front (faults off while it
// does) as repo (name:tag), then removes the local tags: a pull of the
// result downloads the layers (unless another image holds them).
func (r *ColdRegistry) Push(t testing.TB, local, repo string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	ref := r.Ref(repo)
	cfg := r.DockerConfig(t)
	saved := r.front.get()
	r.front.set(Faults{})
	defer r.front.set(saved)
	for _, s := range [][]string{{"tag", local, ref}, {"--config", cfg, "push", ref}, {"rmi", ref}} {
		if _, err := Docker(ctx, s...); err != nil {
			t.Fatal(err)
		}
	}
	return ref
}

// AddImage puts a built cold image into the registry's storage as repo
// (name:tag) directly, in the distribution registry's own layout (blobs
// hard-linked from the image cache: no copy, no upload), as if pushed. The
// registry reads its storage at each request, so it serves it at once.
func (r *ColdRegistry) AddImage(t testing.TB, img *ColdImage, repo string) string {
	t.Helper()
	name, tag, ok := strings.Cut(repo, ":")
	if !ok {
		tag = "latest"
	}
	base := filepath.Join(r.Root, "docker", "registry", "v2")
	link := func(path, digest string) {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(digest), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	blob := func(digest, src string, data []byte) {
		hex := strings.TrimPrefix(digest, "sha256:")
		dst := filepath.Join(base, "blobs", "sha256", hex[:2], hex, "data")
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(dst); err == nil {
			return
		}
		if src == "" {
			if err := os.WriteFile(dst, data, 0o644); err != nil {
				t.Fatal(err)
			}
			return
		}
		if err := os.Link(src, dst); err != nil {
			if err := copyFile(src, dst); err != nil {
				t.Fatal(err)
			}
		}
	}
	repoDir := filepath.Join(base, "repositories", name)
	for _, l := range img.Layers {
		blob(l.Digest, l.Gz, nil)
		link(filepath.Join(repoDir, "_layers", "sha256", strings.TrimPrefix(l.Digest, "sha256:"), "link"), l.Digest)
	}
	blob(img.ConfigDigest, "", img.Config)
	link(filepath.Join(repoDir, "_layers", "sha256", strings.TrimPrefix(img.ConfigDigest, "sha256:"), "link"), img.ConfigDigest)
	blob(img.ManifestDigest, "", img.Manifest)
	mhex := strings.TrimPrefix(img.ManifestDigest, "sha256:")
	link(filepath.Join(repoDir, "_manifests", "revisions", "sha256", mhex, "link"), img.ManifestDigest)
	link(filepath.Join(repoDir, "_manifests", "tags", tag, "current", "link"), img.ManifestDigest)
	link(filepath.Join(repoDir, "_manifests", "tags", tag, "index", "sha256", mhex, "link"), img.ManifestDigest)
	return r.Ref(name + ":" + tag)
}

func copyFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o644)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%x", b)
}

// testPKI: a CA, the server certificate for the namespace's address, and
// the token signing key with its certificate (signed by the CA, which the
// registry's rootcertbundle holds).
type testPKI struct {
	caPEM     []byte
	roots     *x509.CertPool
	server    tls.Certificate
	tokenKey  *ecdsa.PrivateKey
	tokenCert []byte
}

func newTestPKI(t testing.TB, ip net.IP) testPKI {
	t.Helper()
	now := time.Now()
	mk := func(tmpl, parent *x509.Certificate, pub *ecdsa.PublicKey, signer *ecdsa.PrivateKey) []byte {
		der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, signer)
		if err != nil {
			t.Fatal(err)
		}
		return der
	}
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	serial := func() *big.Int { n, _ := rand.Int(rand.Reader, big.NewInt(1<<62)); return n }
	caKey := key()
	caTmpl := &x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: "tandem test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(48 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER := mk(caTmpl, caTmpl, &caKey.PublicKey, caKey)
	ca, _ := x509.ParseCertificate(caDER)
	srvKey := key()
	srvDER := mk(&x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: ip.String()}, IPAddresses: []net.IP{ip},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(48 * time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}, ca, &srvKey.PublicKey, caKey)
	tokKey := key()
	tokDER := mk(&x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: "tandem token signer"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(48 * time.Hour), KeyUsage: x509.KeyUsageDigitalSignature}, ca, &tokKey.PublicKey, caKey)
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	return testPKI{
		caPEM:     pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		roots:     roots,
		server:    tls.Certificate{Certificate: [][]byte{srvDER, caDER}, PrivateKey: srvKey},
		tokenKey:  tokKey,
		tokenCert: tokDER,
	}
}

// tokenServer is the bearer-token realm: Basic credentials (GET) or an
// OAuth2 password grant (POST) in, a JWT (ES256, x5c naming the signing
// certificate) granting the scopes asked for out. No credentials is an
// anonymous token with no access; wrong ones are a 401.
type tokenServer struct {
	user, pass, service, issuer string
	key                         *ecdsa.PrivateKey
	certDER                     []byte
	requests                    atomic.Int64
}

func (s *tokenServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	var user, pass string
	var scopes []string
	switch r.Method {
	case http.MethodGet:
		user, pass, _ = r.BasicAuth()
		scopes = r.URL.Query()["scope"]
	case http.MethodPost:
		r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad form", http.StatusBadRequest)
			return
		}
		if r.PostForm.Get("grant_type") != "password" {
			http.Error(w, `{"error":"unsupported_grant_type"}`, http.StatusBadRequest)
			return
		}
		user, pass = r.PostForm.Get("username"), r.PostForm.Get("password")
		scopes = strings.Fields(r.PostForm.Get("scope"))
	default:
		http.Error(w, "method", http.StatusMethodNotAllowed)
		return
	}
	type access struct {
		Type    string   `json:"type"`
		Name    string   `json:"name"`
		Actions []string `json:"actions"`
	}
	grants := []access{}
	if user != "" || pass != "" {
		if user != s.user || pass != s.pass {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = w.Write([]byte(`{"errors":[{"code":"UNAUTHORIZED","message":"wrong username or password"}]}`))
			return
		}
		for _, sc := range scopes {
			for _, one := range strings.Fields(sc) {
				typ, rest, ok1 := strings.Cut(one, ":")
				i := strings.LastIndex(rest, ":")
				if !ok1 || i < 0 {
					continue
				}
				grants = append(grants, access{Type: typ, Name: rest[:i], Actions: strings.Split(rest[i+1:], ",")})
			}
		}
	}
	now := time.Now()
	header, _ := json.Marshal(map[string]any{"typ": "JWT", "alg": "ES256", "x5c": []string{base64.StdEncoding.EncodeToString(s.certDER)}})
	claims, _ := json.Marshal(map[string]any{"iss": s.issuer, "sub": user, "aud": s.service, "exp": now.Add(10 * time.Minute).Unix(),
		"nbf": now.Add(-time.Minute).Unix(), "iat": now.Unix(), "jti": randomHex(8), "access": grants})
	enc := base64.RawURLEncoding
	signing := enc.EncodeToString(header) + "." + enc.EncodeToString(claims)
	sum := sha256.Sum256([]byte(signing))
	rr, ss, err := ecdsa.Sign(rand.Reader, s.key, sum[:])
	if err != nil {
		http.Error(w, "sign", http.StatusInternalServerError)
		return
	}
	sig := make([]byte, 64)
	rr.FillBytes(sig[:32])
	ss.FillBytes(sig[32:])
	token := signing + "." + enc.EncodeToString(sig)
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"token": token, "access_token": token, "expires_in": 600, "issued_at": now.UTC().Format(time.RFC3339)})
}

// coldFront is the TLS front: a reverse proxy to the registry's socket,
// with faults and counters.
type coldFront struct {
	mu     sync.Mutex
	faults Faults
	used   int // requests the faults applied to, against Times
	st     ColdStats
	tokens *atomic.Int64
	proxy  *httputil.ReverseProxy
	closed chan struct{}
}

func (f *coldFront) start(t testing.TB, ns *Netns, host, sock string, cert tls.Certificate) {
	t.Helper()
	f.closed = make(chan struct{})
	upstream, _ := url.Parse("http://registry")
	f.proxy = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(upstream)
			pr.Out.Host = pr.In.Host // the registry names itself by the front's address
			pr.Out.Header.Set("X-Forwarded-Proto", "https")
		},
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			},
			MaxIdleConnsPerHost: 256,
			DisableCompression:  true,
		},
		FlushInterval: -1,
		ErrorLog:      log.New(io.Discard, "", 0), // the readiness poll before the socket exists
	}
	ln, err := ns.Listen("tcp", host)
	if err != nil {
		t.Fatalf("cold registry front listen: %v", err)
	}
	srv := &http.Server{
		Handler:           f,
		TLSConfig:         &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"http/1.1"}},
		ReadHeaderTimeout: 30 * time.Second,
		ConnState: func(_ net.Conn, s http.ConnState) {
			if s == http.StateNew {
				f.mu.Lock()
				f.st.Conns++
				f.mu.Unlock()
			}
		},
	}
	go func() { _ = srv.Serve(tls.NewListener(ln, srv.TLSConfig)) }()
	t.Cleanup(func() {
		close(f.closed)
		_ = srv.Close()
	})
}

func (f *coldFront) set(faults Faults) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults, f.used = faults, 0
}

func (f *coldFront) get() Faults {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.faults
}

func (f *coldFront) stats() ColdStats {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.st
	if f.tokens != nil {
		s.TokenRequests = f.tokens.Load()
	}
	return s
}

func (f *coldFront) reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.st = ColdStats{}
	if f.tokens != nil {
		f.tokens.Store(0)
	}
}

// blobDigest is the digest of a blob path (/v2/<name>/blobs/<digest>).
func blobDigest(path string) (string, bool) {
	i := strings.LastIndex(path, "/blobs/")
	if !strings.HasPrefix(path, "/v2/") || i < 0 {
		return "", false
	}
	d := path[i+len("/blobs/"):]
	if !strings.HasPrefix(d, "sha256:") || strings.Contains(d, "/") {
		return "", false // uploads/ and the like
	}
	return d, true
}

func (f *coldFront) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	digest, isBlob := blobDigest(r.URL.Path)
	isBlob = isBlob && r.Method == http.MethodGet
	ranged := r.Header.Get("Range") != ""
	f.mu.Lock()
	f.st.Requests++
	var apply bool
	var faults Faults
	if isBlob {
		f.st.BlobGets++
		if ranged {
			f.st.RangedGets++
		}
		faults = f.faults
		apply = faults.active()
		if apply && faults.OnlyRanged && !ranged {
			apply = false
		}
		if apply && len(faults.Digests) > 0 {
			apply = false
			for _, d := range faults.Digests {
				apply = apply || d == digest
			}
		}
		if apply && faults.Times > 0 {
			apply = f.used < faults.Times
		}
		if apply {
			f.used++
			f.st.Faulted++
		}
	}
	f.mu.Unlock()
	if !isBlob {
		f.proxy.ServeHTTP(w, r)
		return
	}
	bw := &blobWriter{ResponseWriter: w, front: f, ctx: r.Context()}
	if apply {
		bw.faults = faults
		if faults.RefuseRange {
			r.Header.Del("Range")
			r.Header.Del("If-Range")
		}
	}
	f.proxy.ServeHTTP(bw, r)
}

// active says whether f does anything wrong at all.
func (f Faults) active() bool { return f.RefuseRange || f.StallAfter > 0 || f.Corrupt }

// blobWriter is the answer to one blob GET on its way out.
type blobWriter struct {
	http.ResponseWriter
	front   *coldFront
	ctx     context.Context
	faults  Faults
	pos     int64 // offset in the blob of the next byte
	written int64 // body bytes of this answer so far
}

func (b *blobWriter) Unwrap() http.ResponseWriter { return b.ResponseWriter }

func (b *blobWriter) WriteHeader(code int) {
	if b.faults.RefuseRange {
		b.Header().Del("Accept-Ranges")
	}
	if code == http.StatusPartialContent {
		// bytes START-END/SIZE
		cr := strings.TrimPrefix(b.Header().Get("Content-Range"), "bytes ")
		if start, _, ok := strings.Cut(cr, "-"); ok {
			b.pos, _ = strconv.ParseInt(start, 10, 64)
		}
	}
	b.ResponseWriter.WriteHeader(code)
}

var errStalled = errors.New("cold registry: stalled on purpose")

func (b *blobWriter) Write(p []byte) (int, error) {
	stall := false
	if b.faults.StallAfter > 0 {
		left := b.faults.StallAfter - b.written
		if left <= 0 {
			p, stall = nil, true
		} else if int64(len(p)) > left {
			p, stall = p[:left], true
		}
	}
	if b.faults.Corrupt && b.faults.CorruptAt >= b.pos && b.faults.CorruptAt < b.pos+int64(len(p)) {
		q := append([]byte(nil), p...)
		q[b.faults.CorruptAt-b.pos] ^= 0xff
		p = q
	}
	n, err := b.ResponseWriter.Write(p)
	b.pos += int64(n)
	b.written += int64(n)
	if n > 0 {
		b.front.mu.Lock()
		b.front.st.BlobBytes += int64(n)
		b.front.st.LastBlobByte = time.Now()
		b.front.mu.Unlock()
	}
	if err != nil || !stall {
		return n, err
	}
	_ = http.NewResponseController(b.ResponseWriter).Flush()
	select {
	case <-b.ctx.Done():
	case <-b.front.closed:
	}
	return n, errStalled
}
