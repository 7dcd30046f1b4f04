package fastpull

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

const (
	hexA = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	hexB = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

func manifestJSON(mediaType, digest string, size int64, urls string) string {
	return `{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",
"config":{"mediaType":"application/vnd.docker.container.image.v1+json","size":10,"digest":"sha256:` + hexB + `"},
"layers":[{"mediaType":"` + mediaType + `","size":` + jsonInt(size) + `,"digest":"` + digest + `"` + urls + `}]}`
}

func jsonInt(n int64) string { b, _ := json.Marshal(n); return string(b) }

func TestPlanLayers(t *testing.T) {
	gz := "application/vnd.docker.image.rootfs.diff.tar.gzip"
	for _, c := range []struct {
		name, manifest string
		diffIDs        []string
		want           string // "" accepted, else a part of the error
	}{
		{"gzip", manifestJSON(gz, "sha256:"+hexA, 100, ""), []string{"sha256:" + hexB}, ""},
		{"oci tar", manifestJSON("application/vnd.oci.image.layer.v1.tar", "sha256:"+hexA, 100, ""), []string{"sha256:" + hexB}, ""},
		{"zstd", manifestJSON("application/vnd.oci.image.layer.v1.tar+zstd", "sha256:"+hexA, 100, ""), []string{"sha256:" + hexB}, "media type"},
		{"foreign", manifestJSON(gz, "sha256:"+hexA, 100, `,"urls":["https://x/y"]`), []string{"sha256:" + hexB}, "foreign"},
		{"more diff_ids", manifestJSON(gz, "sha256:"+hexA, 100, ""), []string{"sha256:" + hexB, "sha256:" + hexB}, "diff_ids"},
		{"bad diff_id", manifestJSON(gz, "sha256:"+hexA, 100, ""), []string{"sha256:" + strings.ToUpper(hexB)}, "diff_id"},
		{"diff_id path", manifestJSON(gz, "sha256:"+hexA, 100, ""), []string{"sha256:../../" + hexB[6:]}, "diff_id"},
		{"zero size", manifestJSON(gz, "sha256:"+hexA, 0, ""), []string{"sha256:" + hexB}, "size"},
		{"huge size", manifestJSON(gz, "sha256:"+hexA, 1<<50, ""), []string{"sha256:" + hexB}, "size"},
		{"sha512", manifestJSON(gz, "sha512:"+hexA+hexA, 100, ""), []string{"sha256:" + hexB}, "digest"},
	} {
		m, err := v1.ParseManifest(bytes.NewReader([]byte(c.manifest)))
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		ls, err := planLayers(m, c.diffIDs)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.want == "" && (len(ls) != 1 || ls[0].id != hexA[:12] || ls[0].size != 100):
			t.Errorf("%s: %+v", c.name, ls)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.want)
		}
	}
}

// FuzzPlanLayers: whatever manifest and config a registry sends, an
// accepted layer has a sha256 digest, a diff_id that is a clean file name
// part, and a size inside the bounds.
func FuzzPlanLayers(f *testing.F) {
	f.Add([]byte(manifestJSON("application/vnd.docker.image.rootfs.diff.tar.gzip", "sha256:"+hexA, 100, "")),
		[]byte(`{"rootfs":{"type":"layers","diff_ids":["sha256:`+hexB+`"]}}`))
	f.Fuzz(func(t *testing.T, manifest, config []byte) {
		m, err := v1.ParseManifest(bytes.NewReader(manifest))
		if err != nil {
			return
		}
		var cfg struct {
			RootFS struct {
				DiffIDs []string `json:"diff_ids"`
			} `json:"rootfs"`
		}
		if json.Unmarshal(config, &cfg) != nil {
			return
		}
		ls, err := planLayers(m, cfg.RootFS.DiffIDs)
		if err != nil {
			return
		}
		for _, l := range ls {
			if len(l.digest) != 71 || len(l.diffID) != 71 || strings.ContainsAny(l.diffID[7:], "/.") || l.size <= 0 || l.size > maxBlob {
				t.Fatalf("accepted %+v", l)
			}
		}
	})
}
