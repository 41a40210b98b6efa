// Spike loader: attach one program of spike.bpf.o to FUNC_OFFSET in BINARY
// for PID, print "attached", wait for stdin EOF, print the fire count.
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <bpf/libbpf.h>
#include <bpf/bpf.h>

int main(int argc, char **argv)
{
	if (argc != 6) {
		fprintf(stderr, "usage: loader OBJ PROG PID BINARY OFFSET\n");
		return 2;
	}
	struct bpf_object *obj = bpf_object__open_file(argv[1], NULL);
	if (!obj) { perror("open"); return 1; }
	struct bpf_program *p;
	bpf_object__for_each_program(p, obj)
		bpf_program__set_autoload(p, 0);
	struct bpf_program *prog = bpf_object__find_program_by_name(obj, argv[2]);
	if (!prog) { fprintf(stderr, "no program %s\n", argv[2]); return 1; }
	bpf_program__set_autoload(prog, 1);
	struct bpf_map *ro = bpf_object__find_map_by_name(obj, ".rodata");
	size_t sz;
	unsigned *rod = bpf_map__initial_value(ro, &sz);
	rod[0] = atoi(argv[3]);	/* tgid */
	int err = bpf_object__load(obj);
	if (err) { fprintf(stderr, "load failed: %d\n", err); puts("load-failed"); fflush(stdout); return 3; }
	struct bpf_link *l = bpf_program__attach_uprobe(prog, 0, atoi(argv[3]), argv[4], strtoul(argv[5], 0, 0));
	if (!l) { perror("attach"); return 1; }
	puts("attached"); fflush(stdout);
	char buf[64];
	while (read(0, buf, sizeof buf) > 0) ;
	struct bpf_map *bss = bpf_object__find_map_by_name(obj, ".bss");
	unsigned long long v = 0; unsigned k = 0;
	bpf_map__lookup_elem(bss, &k, sizeof k, &v, sizeof v, 0);
	printf("fired %llu\n", v);
	return 0;
}
