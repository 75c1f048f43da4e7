// Command etcd is etcd's own server main (go.etcd.io/etcd/server/v3/etcdmain), built at the
// version k8s.io/kubernetes requires, because Debian 12's etcd (3.4) is older than the
// Kubernetes release pinned in versions.env supports.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
