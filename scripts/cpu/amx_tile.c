// Run one AMX tile instruction, with or without asking the kernel for AMX tile permission first.
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
struct cfg { unsigned char palette, start; unsigned char r[14]; unsigned short colsb[16]; unsigned char rows[16]; };
int main(int argc, char **argv) {
  unsigned long mask = 0;
  if (argc > 1 && !strcmp(argv[1], "request"))
    printf("request: %ld\n", syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
  syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask);
  printf("perm mask 0x%lx\n", mask); fflush(stdout);
  struct cfg c; memset(&c, 0, sizeof c); c.palette = 1; c.rows[0] = 16; c.colsb[0] = 64;
  _tile_loadconfig(&c);
  _tile_zero(0);
  static char buf[1024]; _tile_stored(0, buf, 64);
  _tile_release();
  printf("tile ok\n");
  return 0;
}
