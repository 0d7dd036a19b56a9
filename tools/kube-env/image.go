// kubeharness image: writes a one-layer OCI image archive (FROM scratch) that
// `ctr images import` accepts, for images built here from source (pause, podinfo): no registry,
// no builder daemon.
//
//	kubeharness image --out F.tar --name docker.io/library/x:tag [--entrypoint /x,arg] [--user 65532:65532] SRC=DEST[:MODE]...
package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"
)

func image(args []string) int {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	out := fs.String("out", "", "output OCI archive (required)")
	name := fs.String("name", "", "image name with tag, e.g. docker.io/library/podinfo:6 (required)")
	entry := fs.String("entrypoint", "", "comma-separated entrypoint")
	user := fs.String("user", "", "user[:group]")
	if fs.Parse(args) != nil || *out == "" || *name == "" || fs.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: kubeharness image --out F.tar --name REF [--entrypoint /x] [--user U:G] SRC=DEST[:MODE]...")
		return 2
	}
	if err := writeImage(*out, *name, *entry, *user, fs.Args()); err != nil {
		return fail(err)
	}
	return 0
}

type blob struct {
	mediaType string
	data      []byte
}

func (b blob) digest() string { return fmt.Sprintf("sha256:%x", sha256.Sum256(b.data)) }

func (b blob) desc() map[string]any {
	return map[string]any{"mediaType": b.mediaType, "digest": b.digest(), "size": len(b.data)}
}

func writeImage(out, name, entrypoint, user string, files []string) error {
	epoch := time.Unix(0, 0).UTC()
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	type entry struct {
		dest string
		mode int64
		data []byte
	}
	var entries []entry
	dirs := map[string]bool{}
	for _, f := range files {
		src, dest, ok := strings.Cut(f, "=")
		if !ok {
			return fmt.Errorf("%q: want SRC=DEST[:MODE]", f)
		}
		mode := int64(0o555)
		if d, m, ok := strings.Cut(dest, ":"); ok {
			v, err := strconv.ParseInt(m, 8, 32)
			if err != nil {
				return fmt.Errorf("%q: bad mode: %v", f, err)
			}
			dest, mode = d, v
		}
		data, err := os.ReadFile(src)
		if err != nil {
			return err
		}
		dest = strings.TrimPrefix(path.Clean("/"+dest), "/")
		for d := path.Dir(dest); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
		entries = append(entries, entry{dest, mode, data})
	}
	var parents []string
	for d := range dirs {
		parents = append(parents, d)
	}
	for _, d := range sortedByDepth(parents) {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: epoch}); err != nil {
			return err
		}
	}
	for _, e := range entries {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: e.dest, Mode: e.mode, Size: int64(len(e.data)), ModTime: epoch}); err != nil {
			return err
		}
		if _, err := tw.Write(e.data); err != nil {
			return err
		}
	}
	// a /tmp for images that need one (read-only root filesystems mount an emptyDir over it)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777, ModTime: epoch}); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	l := blob{"application/vnd.oci.image.layer.v1.tar", layer.Bytes()}
	cfg := map[string]any{}
	if entrypoint != "" {
		cfg["Entrypoint"] = strings.Split(entrypoint, ",")
	}
	if user != "" {
		cfg["User"] = user
	}
	cfg["Env"] = []string{"PATH=/"}
	config, _ := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH, "os": "linux", "created": epoch.Format(time.RFC3339),
		"config": cfg,
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{l.digest()}},
	})
	c := blob{"application/vnd.oci.image.config.v1+json", config}
	manifest, _ := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": c.desc(), "layers": []any{l.desc()},
	})
	m := blob{"application/vnd.oci.image.manifest.v1+json", manifest}
	md := m.desc()
	tag := name[strings.LastIndex(name, ":")+1:]
	md["annotations"] = map[string]string{"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}
	md["platform"] = map[string]string{"architecture": runtime.GOARCH, "os": "linux"}
	index, _ := json.Marshal(map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []any{md}})

	f, err := os.Create(out + ".tmp")
	if err != nil {
		return err
	}
	defer f.Close()
	ow := tar.NewWriter(f)
	add := func(n string, data []byte) error {
		if err := ow.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: n, Mode: 0o644, Size: int64(len(data)), ModTime: epoch}); err != nil {
			return err
		}
		_, err := ow.Write(data)
		return err
	}
	if err := add("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return err
	}
	for _, b := range []blob{l, c, m} {
		if err := add("blobs/sha256/"+strings.TrimPrefix(b.digest(), "sha256:"), b.data); err != nil {
			return err
		}
	}
	if err := add("index.json", index); err != nil {
		return err
	}
	if err := ow.Close(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(out+".tmp", out)
}

func sortedByDepth(ds []string) []string {
	sort.Slice(ds, func(i, j int) bool {
		if a, b := strings.Count(ds[i], "/"), strings.Count(ds[j], "/"); a != b {
			return a < b
		}
		return ds[i] < ds[j]
	})
	return ds
}
